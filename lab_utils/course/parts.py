"""The course's parts: which part of the engine each lab's exercise writes, and the learner's versions of them.

The course's labs each have the learner rewrite one part of this engine: the scheduling step (lab 01), the
block allocator and the slot mapping (lab 02), the token-budget step (lab 03), the prefix cache (lab 04). Each
part is a method of a core class (or one function) whose reference version lives in the engine itself; a
learner's version has the same name and signature. `EngineParts` says which version an engine runs (it is
what the engine's one seam for replacing a part, `lab_utils.engine.replaceable`, asks):

    parts = EngineParts({"block_manager.grow": my_grow})   # everything else: the reference
    engine = LLMEngine(model, config, parts=parts)

The engine then builds its `BlockManager` as a subclass whose `grow` is `my_grow` (so `self` inside it is the
real block manager), and runs it. `lab_utils.course.learner_parts` collects a learner's parts across labs (saved in files,
as tiny-llm keeps a student package beside its reference one); this module only knows how to plug them in.

An exception inside a learner's part reaches the lab as `LearnerPartError` naming the part (with the original
error chained); `NotImplementedError` (an exercise not yet written) passes through unchanged.
"""
from __future__ import annotations

import functools
import inspect
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping

from lab_utils.engine.replaceable import LearnerPartError  # noqa: F401  (the course's parts raise it)


@dataclass(frozen=True)
class Part:
    name: str  # "<component>.<attribute>", e.g. "block_manager.grow"
    lab: str  # the lab whose exercise writes it
    signature: str  # what the learner's function looks like
    summary: str  # one line: what it must do
    ref: str = ""  # where the reference lives, "module:Qualified.name" (default: the engine's core classes)
    # False: used in its own lab only; later labs run the engine's fast version (a learner's slot mapping forces
    # the slow reference attention path, several times slower on a CPU)
    carry: bool = True

    def reference(self) -> Callable:
        """The engine's own version of this part."""
        import importlib

        path = self.ref or {"scheduler": "lab_utils.engine.scheduler:Scheduler",
                            "block_manager": "lab_utils.engine.kv.block_manager:BlockManager",
                            "attention": "lab_utils.engine.attention"}[self.component]
        module, _, qual = path.partition(":")
        obj = importlib.import_module(module)
        for attr in [a for a in qual.split(".") if a]:
            obj = getattr(obj, attr)
        return obj if self.ref and qual.split(".")[-1] == self.attr else getattr(obj, self.attr)

    @property
    def component(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def attr(self) -> str:
        return self.name.split(".", 1)[1]


# Every part a lab's exercise writes, by lab. A method of the engine's core classes ("scheduler.*",
# "block_manager.*") needs no `ref`: the engine builds the class through `EngineParts.subclass`. A plain function
# names its reference in `ref` ("module:function"); the code that calls it takes the learner's version through
# `EngineParts.function(name, reference)` or an explicit argument.
PARTS: dict[str, Part] = {p.name: p for p in [
    # lab 01: continuous batching
    Part("scheduler.schedule_continuous", "01", "(self) -> SchedulerOutput",
         "one step of continuous batching: retire, admit FCFS within slots/budget/KV, else decode everyone"),
    Part("engine.stop_reason", "01", "(req, token, eos_ids, max_model_len) -> str | None",
         "why a request ends after its newest token: 'stop' (end token), 'length' (max_tokens, max_model_len)",
         ref="lab_utils.engine.engine:stop_reason"),
    # lab 02: the paged KV cache
    Part("block_manager.grow", "02", "(self, req, num_tokens) -> bool",
         "extend req.block_table to cover num_tokens tokens from the free pool; False (no change) if it cannot"),
    Part("block_manager.release", "02", "(self, block_id) -> None",
         "drop one reference to a block; at zero hand it to self.recycle(block_id)"),
    Part("scheduler.make_room", "02", "(self, req, num_tokens, out) -> bool",
         "grow req to num_tokens, preempting the newest running request until it fits; False if req gave way"),
    Part("scheduler.preempt", "02", "(self, req) -> None",
         "preemption: off the batch, blocks freed, to the front of the queue; recompute resets the progress, "
         "swap (preemption_mode) copies the KV out first (swap_out) and keeps it"),
    Part("attention.slot_mapping", "02", "(block_tables, context_lens, query_lens, block_size) -> list[int]",
         "the cache slot of every token computed in this step, in step order", carry=False),
    # lab 03: chunked prefill under a token budget
    Part("scheduler.schedule_token_budget", "03", "(self) -> SchedulerOutput",
         "vLLM V1's step: running requests first (decode or next chunk), then new prompts, within the budget"),
    # lab 04: prefix caching
    Part("block_manager.hash_block", "04", "(self, parent_hash, token_ids) -> int",
         "a full block's name: a hash of its parent block's hash and its own token ids (a chain)"),
    Part("block_manager.commit_full_blocks", "04", "(self, req) -> None",
         "name each of req's blocks that just became full (chained hash), so later prompts can find it"),
    Part("block_manager.match_prefix", "04", "(self, req) -> list[int]",
         "the cached blocks holding the prompt's leading full blocks (at least one prompt token left to compute)"),
    Part("block_manager.recycle", "04", "(self, block_id) -> None",
         "a block nobody references: keep it in the LRU cache if it holds a named prefix, else free it"),
    Part("block_manager.evict", "04", "(self) -> int",
         "take the least recently used cached block with no reference out of the cache and return its id"),
    # lab 05: quantization: INT8/INT4 weights, the FP8 KV cache
    Part("quant.quantize_per_channel_int8", "05", "(w) -> (q, scale)",
         "symmetric INT8, one scale per output row: q int8 [out, in] in -127..127, scale float32 [out, 1]",
         ref="lab_utils.quant.linear:quantize_per_channel_int8"),
    Part("quant.quantize_per_group_int4", "05", "(w, group_size) -> (q, scale)",
         "symmetric INT4, one fp16 scale per group of inputs (rounded up), q int8 in -7..7, scale [out, groups]",
         ref="lab_utils.quant.linear:quantize_per_group_int4"),
    Part("quant.dequantize_int4", "05", "(q, scale, group_size) -> Tensor",
         "INT4 back to the compute dtype: each group times its scale (runs in every forward of an Int4Linear)",
         ref="lab_utils.quant.linear:dequantize_int4"),
    Part("kv_cache.fp8_encode", "05", "(x) -> Tensor",
         "K or V to FP8 E4M3 bytes: saturate at ±448, round to E4M3, the bit patterns as uint8",
         ref="lab_utils.engine.kv.kv_cache:fp8_encode"),
    Part("kv_cache.fp8_decode", "05", "(bits, dtype) -> Tensor",
         "FP8 E4M3 bytes back to values: sign, exponent (bias 7), mantissa, subnormals; in `dtype`",
         ref="lab_utils.engine.kv.kv_cache:fp8_decode"),
    # lab 07: speculative decoding: the verify step
    Part("spec.residual", "07", "(p, q) -> Tensor",
         "where to draw after a rejection: max(0, p - q) normalised (p itself when p == q)",
         ref="lab_utils.speculative.verify:residual"),
    Part("spec.accept_reject", "07", "(p, q, draft, u) -> (n_accepted, dist)",
         "keep guess i while u[i] < min(1, p_i(x)/q_i(x)); the residual at the first rejection, else p[k]",
         ref="lab_utils.speculative.verify:accept_reject"),
    Part("spec.verify_greedy", "07", "(logits, draft) -> list[int]",
         "greedy verify: keep guesses while each is the target's argmax, then its argmax (correction or bonus)",
         ref="lab_utils.speculative.verify:verify_greedy"),
    Part("spec.rollback", "07", "(req, block_manager, num_guesses, num_accepted) -> None",
         "after a verify: take the guesses out of the request, uncount the rejected ones, free their blocks",
         ref="lab_utils.speculative.hook:rollback"),
    # lab 09: tensor parallelism
    Part("tensor_parallel.shard_weights", "09", "(w, rank, world_size, heads_per_kv, head_dim) -> dict",
         "this rank's slice of a layer: q/k/v, gate/up by rows (column-parallel), o, down by columns (row-parallel)",
         ref="lab_utils.parallel.tensor_parallel:shard_weights"),
    Part("tensor_parallel.row_parallel", "09", "(x, weight, all_reduce) -> Tensor",
         "a row-parallel linear: this rank's partial product, summed over the ranks by the all-reduce",
         ref="lab_utils.parallel.tensor_parallel:row_parallel"),
    # lab 10: prefill/decode disaggregation: the KV hand-off
    Part("disagg.export_kv", "10", "(cache, block_table, num_tokens, block_size) -> dict",
         "prefill side: every cache tensor's entries of the first num_tokens tokens, gathered in token order",
         ref="lab_utils.disagg.workers:export_kv"),
    Part("disagg.request_meta", "10", "(req) -> dict",
         "prefill side: what travels with the KV: ids, prompt, sampling params, the first token, its timestamps",
         ref="lab_utils.disagg.workers:request_meta"),
    Part("disagg.import_kv", "10", "(cache, block_table, kv, block_size) -> None",
         "decode side: received KV scattered into the request's newly allocated blocks",
         ref="lab_utils.disagg.workers:import_kv"),
    Part("disagg.resume_prefilled", "10", "(req, first_token, kv) -> None",
         "decode side: a fresh request becomes the prefilled one (first token, prompt computed, swapped-in KV)",
         ref="lab_utils.disagg.workers:resume_prefilled"),
    # lab 12: the server's streaming loop
    Part("server.stream_sse", "12", "(outputs, to_chunk, abort) -> AsyncIterator[str]",
         "the server's streaming loop: one SSE event per engine output, then [DONE]; abort() if the client left",
         ref="lab_utils.server.streaming:stream_sse"),
    # lab 14: the host KV tier under the prefix cache
    Part("block_manager.promote", "14", "(self, name, ids, hits) -> int | None",
         "the device misses block `name` but the host tier holds it: copy it into a device block, named and "
         "cached as if it had never left (never evicting one of `hits`); None when it cannot"),
    # lab 15: token efficiency: agent fan-out
    Part("efficiency.fan_out", "15", "(engine, prompts, params) -> list[RequestOutput]",
         "sub-tasks sharing a prefix: the first until its prompt is computed, then the rest together (prefix once)",
         ref="lab_utils.efficiency.fanout:fan_out"),
    # lab 15: token efficiency: routing between a small model and the target
    Part("efficiency.route", "15", "(task, small_scores, threshold) -> str",
         "'small' when the small model's confidence in its pick (softmax over its option scores) >= threshold",
         ref="lab_utils.efficiency.routing:route"),
    # lab 16: the decode attention kernel (Triton; saved with its kernels by lab_utils.kernels.learner_kernel)
    Part("kernel.paged_decode", "16",
         "(q, k_cache, v_cache, block_tables, context_lens, block_size, scale) -> Tensor",
         "decode attention through the block tables in place: online softmax, each query head on its KV head, the "
         "last block masked", ref="lab_utils.kernels.paged_decode_triton:paged_decode"),
    Part("kernel.paged_decode_split", "16",
         "(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, num_splits) -> Tensor",
         "split-KV: num_splits programs per head over slices of the context, combined by their log-sum-exps",
         ref="lab_utils.kernels.paged_decode_triton:paged_decode_split"),
]}


def check_signature(name: str, fn: Callable) -> None:
    """A learner's function must take the reference's parameters, in order (names may differ)."""
    if name not in PARTS:
        raise KeyError(f"unknown engine part {name!r}; the parts are: {', '.join(PARTS)}")
    if not callable(fn):
        raise TypeError(f"the part {name} must be a function, got {type(fn).__name__}")
    want = PARTS[name].signature.split("->")[0].strip()[1:-1]
    n_want = len([a for a in want.split(",") if a.strip()])
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return
    required = [p for p in params if p.default is p.empty]
    if not len(required) <= n_want <= len(params):  # extra parameters with defaults are fine
        raise TypeError(f"your {name} takes {len(params)} parameter(s) ({', '.join(p.name for p in params)}) but "
                        f"the engine calls it as {PARTS[name].attr}{PARTS[name].signature}")


def _guarded(name: str, fn: Callable, calls: Counter | None = None) -> Callable:
    """Call a learner's part, counting the call in `calls`; anything it raises (but NotImplementedError) comes
    back naming the part."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if calls is not None:
            calls[name] += 1
        try:
            return fn(*args, **kwargs)
        except (NotImplementedError, LearnerPartError):
            raise
        except Exception as err:
            raise LearnerPartError(f"your {name} raised {type(err).__name__}: {err}") from err

    call.__learner_part__ = name
    call.__part_label__ = part_label(name)  # how the engine's invariants name it in a message
    return call


def part_label(name: str) -> str:
    """A learner's part in messages: its name, its lab and the file it is saved in."""
    from lab_utils.course.learner_parts import learner_dir

    part = PARTS[name]
    return f"your {name} (lab {part.lab}, {learner_dir().name}/{part.component}.py)"


class EngineParts:
    """Which implementation of each part an engine runs. Empty = the reference engine.

    `calls` counts the calls of each learner part by the engines built with these parts (a lab's "the run used
    your parts" claim reads it: a part that is registered but never runs does not count)."""

    def __init__(self, overrides: Mapping[str, Callable] | None = None,
                 origins: Mapping[str, str] | None = None) -> None:
        self.overrides: dict[str, Callable] = {}
        self.origins: dict[str, str] = dict(origins or {})
        self.calls: Counter[str] = Counter()
        for name, fn in (overrides or {}).items():
            check_signature(name, fn)
            self.overrides[name] = fn

    def __bool__(self) -> bool:
        return bool(self.overrides)

    def is_learners(self, name: str) -> bool:
        return name in self.overrides

    def without(self, *names: str) -> "EngineParts":
        """The same parts but `names`, which fall back to the reference (e.g. a lab-01 step in a chunked run)."""
        keep = {n: f for n, f in self.overrides.items() if n not in names}
        return EngineParts(keep, {n: o for n, o in self.origins.items() if n in keep})

    def subclass(self, base: type, component: str) -> type:
        """`base` itself, or a subclass of it whose methods are the learner's parts for `component`. With any
        learner part in the engine the class also runs the engine's invariants (`guarded`: e.g. the scheduler checks every
        step a policy returns, since a learner's allocator can break what a reference policy relies on)."""
        methods = {PARTS[n].attr: _guarded(n, fn, self.calls) for n, fn in self.overrides.items()
                   if PARTS[n].component == component}
        if not self.overrides:
            return base
        return type(f"{'Learner' if methods else 'Guarded'}{base.__name__}", (base,), {"guarded": True, **methods})

    def function(self, name: str, reference: Callable) -> Callable:
        fn = self.overrides.get(name)
        return reference if fn is None else _guarded(name, fn, self.calls)

    def stall_error(self, engine, stuck) -> "LearnerPartError | None":
        """The engine scheduled nothing while `stuck` waits: name the learner's parts that hand out and return
        KV blocks (the usual cause), with their labs and files."""
        bm = engine.block_manager
        suspects = [f"{n} (lab {PARTS[n].lab}, {self.origins.get(n, 'yours')})"
                    for n in sorted(self.overrides, key=lambda n: (PARTS[n].lab, n))
                    if n in PARTS and n.split(".")[0] in ("block_manager", "scheduler")]
        return LearnerPartError(
            f"the scheduler made no progress with {stuck}: {bm.num_free_blocks} of {bm.num_blocks} KV "
            f"blocks are free. Your parts that hand out and return blocks decide this: "
            f"{'; '.join(suspects) or ', '.join(sorted(self.overrides))}. Check that released "
            f"blocks go back to the pool and that a request that fits is admitted")

    def describe(self) -> str:
        """One line per part: whose version the engine runs."""
        lines = []
        for name, part in PARTS.items():
            who = self.origins.get(name, "yours") if name in self.overrides else "reference"
            lines.append(f"  lab {part.lab}  {name:34s} {who}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"EngineParts({sorted(self.overrides)})"


