"""Grammar-constrained decoding: the output of a request is valid JSON (for a schema), matches a regex, is one
of a list of strings, or follows a grammar, by construction.

A compiled grammar plus a *matcher* (the parser's state after the tokens so far) says which tokens may come
next. Each step, for every constrained request that samples, the matcher fills a *bitmask* (one bit per
vocabulary token, packed 32 to an int32); the mask step sets the logits of forbidden tokens to -inf, the
sampler picks a token as usual, and the matcher *advances* by that token. Unconstrained requests in the same
batch are never touched: their rows of logits are not even read.

The grammar library is xgrammar (the default structured-output backend of vLLM and SGLang, installed with
vLLM): it precomputes, per grammar state, which tokens are always/never allowed, so filling a bitmask costs
microseconds to a millisecond on a 49k vocabulary; it supports JSON schema, regex, EBNF and Lark; and it can
roll a matcher back, which speculative decoding needs.

Cost made visible: filling the masks is CPU work on the critical path of a step. With `overlap=True` (the
default) the masks a step needs are filled by a worker thread *while that step's forward pass runs*, as
vLLM's engine core does (`execute_model(non_block=True)`, then `get_grammar_bitmask`, then `sample_tokens`);
with `overlap=False` they are filled before the forward. `step_log` records, per step, the time spent
filling, the time the step waited for the masks, applying them and advancing the matchers.

Speculative decoding: guesses are checked against the grammar before the forward; guesses after the first
one the grammar refuses are dropped (that one stays, and verification rejects it: its masked probability is
0), and each verified row gets the mask of the state after the guesses before it. So the verifier samples
from the constrained distribution at every position, and greedy output is identical to non-speculative
constrained decoding.

Preemption keeps the matcher: a preempted request keeps its generated tokens (recompute) or its KV (swap),
and its matcher already accepted exactly those tokens.

The two functions a learner writes in lab 13 are `apply_token_bitmask` (bitmask -> masked logits) and
`advance_matcher` (feed the accepted tokens to the matcher); `StructuredOutputs(mask_fn=..., advance_fn=...)`
makes the engine run theirs.
"""
from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from lab_utils.structured.params import StructuredOutputParams
from lab_utils.structured.schema import ServerLimit, Unsatisfiable, prepare_schema

MaskFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
AdvanceFn = Callable[[object, list[int]], bool]

CACHE_ENTRIES = 256  # compiled grammars kept (least recently used dropped): a server sees many schemas
STEP_LOG_ENTRIES = 10_000  # constrained steps kept in `step_log` (a server runs for days)
# the finish reason of a request whose grammar left no token to choose: the request's own fault, ended alone
_COMPILER_LOCK = threading.Lock()
DEAD_END = "error: the grammar allows no token here (the schema or grammar cannot be completed)"


class CompileTimeout(ValueError):
    """A grammar took longer to compile than its caller allows ("schema too complex")."""


# -- the mask step (the lab's exercise; these are the reference versions) ---------------------------------
def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask [n, ceil(V/32)] -> bool [n, V]: bit j of word w says whether token 32*w + j is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift on negative words is fine after & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [n, V] -> logits with every token the bitmask forbids at -inf (the allowed ones unchanged)."""
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])
    return logits.masked_fill(~allowed, float("-inf"))


def advance_matcher(matcher, token_ids: list[int]) -> bool:
    """Feed accepted tokens to the grammar matcher in order; False as soon as the grammar refuses one."""
    return all(matcher.accept_token(int(t)) for t in token_ids)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (vLLM builds the same one)."""
    def lit(s: str) -> str:
        esc = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}
        return '"' + "".join(esc.get(c, c if ord(c) >= 0x20 and ord(c) != 0x7F else f"\\u{ord(c):04x}")
                             for c in s) + '"'

    return "root ::= " + " | ".join(lit(c) for c in choices)


def build_grammar(compiler, so: StructuredOutputParams):
    """`so` compiled by an xgrammar GrammarCompiler (the library's own errors pass through)."""
    c, kind = compiler, so.kind
    if kind in ("json", "json_object"):
        schema = so.json if kind == "json" else {"type": "object"}
        text = schema if isinstance(schema, str) else json.dumps(schema)
        strict = so.disable_any_whitespace
        return c.compile_json_schema(text, any_whitespace=not strict, separators=(",", ":") if strict else None)
    if kind == "regex":
        return c.compile_regex(so.regex)
    if kind == "choice":
        return c.compile_grammar(choice_grammar(so.choice))
    return c.compile_grammar(so.grammar) if "::=" in so.grammar else c.compile_lark(so.grammar)


class GrammarCompiler:
    """Compiles structured-output params against one tokenizer, caching by what was asked (a server sees the
    same schema again and again; the `max_entries` most recently used are kept). Safe to call from several
    threads: the server compiles off its event loop. A grammar that leaves no token to start with (a `$ref`
    cycle such as {"$ref": "#"}) or a schema that can never be met is a ValueError here, before any step."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_entries: int = CACHE_ENTRIES) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)  # bounded by our own cache
        self.cache: OrderedDict[tuple, object] = OrderedDict()  # key -> compiled grammar, or the refusal (str)
        self._lock = threading.Lock()
        # Special tokens (<|im_start|>, <filename>, ...) are control tokens, never text, but the library may see
        # them as plain strings (it finds none in a transformers-5 tokenizer): they are cleared from every mask,
        # the stop tokens excepted. `keep` is the bitmask word row with their bits at 0.
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
        special -= set(stop_token_ids)
        self.keep = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
        for i in sorted(t for t in special if 0 <= t < vocab_size):
            w, b = divmod(i, 32)
            self.keep[0, w] = int(self.keep[0, w]) & ~(1 << b) if b < 31 else int(self.keep[0, w]) & 0x7FFFFFFF

    def cached(self, so: StructuredOutputParams) -> bool:
        """True if `compile(so)` answers at once (compiled or refused before)."""
        with self._lock:
            return so.key() in self.cache

    def compile(self, so: StructuredOutputParams, build: Callable | None = None):
        """The compiled grammar for `so` (ValueError if refused). `build(so)` compiles it (default: here, with
        this process's compiler); the server builds in a worker process it can stop."""
        key = so.key()
        with self._lock:
            hit = self.cache.get(key)
            if hit is not None:
                self.cache.move_to_end(key)
        if hit is None:
            hit = self._compile_checked(so, build or self._compile)
            with self._lock:
                self.cache[key] = hit
                while len(self.cache) > self.max_entries:
                    self.cache.popitem(last=False)
        if isinstance(hit, ValueError):
            raise type(hit)(str(hit))
        return hit

    def _compile_checked(self, so: StructuredOutputParams, build: Callable):
        """The compiled grammar, or the ValueError saying why it is refused (kept in the cache like a grammar)."""
        if so.kind == "json":  # narrowed so every output validates, or refused (schema.py)
            schema = json.loads(so.json) if isinstance(so.json, str) else so.json
            try:
                so = dataclasses.replace(so, json=prepare_schema(schema))
            except Unsatisfiable as err:
                return ValueError(f"structured_output.json can never be met: {err}")
            except ServerLimit as err:
                return ServerLimit(f"structured_output.json is beyond a limit of this server: {err}")
            except ValueError as err:
                return ValueError(f"structured_output.json cannot be served so that every output validates: {err}")
        try:
            compiled = build(so)
        except CompileTimeout as err:
            return err
        except Exception as err:  # the library's errors (bad schema, bad regex, ...) name the problem
            why = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", str(err).strip())  # drop "[time] file.cc:123:"
            return ValueError(f"structured_output.{so.kind} could not be compiled: {why[:500]}")
        m = self.matcher(compiled)
        bm = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        m.fill_next_token_bitmask(bm, 0)
        if not m.is_terminated() and not bool(((bm & self.keep) != 0).any()):
            return ValueError(f"structured_output.{so.kind} allows no output: no token can start it (a $ref cycle "
                              f'such as {{"$ref": "#"}}, or constraints that no value meets)')
        return compiled

    def _compile(self, so: StructuredOutputParams):
        return build_grammar(self.compiler, so)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)


class StructuredOutputs:
    """The engine's structured-output hook: one matcher per constrained request, bitmasks per step.

    It answers every method of the engine's `StepHook` (`lab_utils.engine.hooks`) by name; this package imports
    nothing of the engine, which builds the hook (`engine/features.py`). `validate` compiles (in add_request: a
    bad schema is a ValueError there), `add` makes the request's matcher, `filter_guesses` cuts speculative
    guesses, `plan` starts filling this step's masks before the forward, `mask` applies them after it, `pick`
    leaves the tokens to the sampler, `accept` advances the matcher per emitted token, `release`."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, mask_fn: MaskFn | None = None,
                 advance_fn: AdvanceFn | None = None, overlap: bool = True) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self.mask_fn = mask_fn or apply_token_bitmask
        self.advance_fn = advance_fn or advance_matcher
        self.overlap = overlap
        self._compiler: GrammarCompiler | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.matchers: dict[str, object] = {}
        self._pending: tuple[list[tuple[str, int]], Future | dict] | None = None
        self.step_log: deque[dict] = deque(maxlen=STEP_LOG_ENTRIES)  # steps with >= 1 constrained row: ms
        self.dead_ends: set[str] = set()  # requests whose grammar left no token in this step
        self.record: dict[str, list[torch.Tensor]] = {}  # request id -> bitmask rows used, when asked for

    def use(self, mask_fn: MaskFn | None = None, advance_fn: AdvanceFn | None = None,
            overlap: bool | None = None) -> "StructuredOutputs":
        """Swap in a mask step (a learner's `apply_token_bitmask` / `advance_matcher`) or flip the overlap;
        None keeps what is there. Returns self."""
        for name, fn in (("mask_fn", mask_fn), ("advance_fn", advance_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a function, got {type(fn).__name__}")
        self.mask_fn = mask_fn or self.mask_fn
        self.advance_fn = advance_fn or self.advance_fn
        if overlap is not None:
            self.overlap = bool(overlap)
        return self

    # -- requests ---------------------------------------------------------------------------------------
    @property
    def compiler(self) -> GrammarCompiler:
        with _COMPILER_LOCK:  # made once, also when two server threads ask first at the same time
            if self._compiler is None:
                if self.tokenizer is None:
                    raise ValueError("structured_output needs the engine's tokenizer; this engine has none")
                self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.stop_token_ids)
        return self._compiler

    def compile(self, so) -> object | None:
        so = StructuredOutputParams.coerce(so)
        return None if so is None else self.compiler.compile(so)

    def answers_at_once(self, so: StructuredOutputParams) -> bool:
        """True if `compile(so)` returns at once: compiled (or refused) before. Never loads the compiler."""
        return self._compiler is not None and self._compiler.cached(so)

    def validate(self, params) -> object | None:
        return self.compile(params.structured_output)

    def add(self, request_id: str, compiled) -> None:
        if compiled is not None:
            self.matchers[request_id] = self.compiler.matcher(compiled)

    def release(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        self.dead_ends.discard(request_id)

    def active(self) -> bool:
        return bool(self.matchers)

    def record_masks(self, request_id: str) -> None:
        """Keep the bitmask rows this request is given (lab 13's picture of the mask over one generation)."""
        self.record[request_id] = []

    # -- speculative guesses ----------------------------------------------------------------------------
    def filter_guesses(self, req, prop):
        """Keep the guesses the grammar accepts, plus the first refused one (verification rejects it)."""
        m = self.matchers.get(req.request_id)
        if m is None or not prop.token_ids:
            return prop
        n_ok = 0
        for tok in prop.token_ids:
            if m.is_terminated() or not m.accept_token(int(tok)):
                break
            n_ok += 1
        if n_ok:
            m.rollback(n_ok)
        keep = min(len(prop.token_ids), n_ok + 1)
        if keep == len(prop.token_ids):
            return prop
        return type(prop)(prop.token_ids[:keep], None if prop.probs is None else prop.probs[:keep])

    # -- one step ---------------------------------------------------------------------------------------
    def plan(self, batch) -> None:
        """Before the forward (`batch`: the engine's `StepBatch`): start filling the masks of its rows."""
        self.prepare(batch.scheduled, batch.guesses)

    def mask(self, batch) -> None:
        """After the forward: forbidden tokens of constrained rows -> -inf."""
        batch.logits = self.apply(batch.logits, batch.to_sample)

    def pick(self, batch) -> list[list[int]] | None:
        """None: the sampler picks the tokens (from the masked logits)."""
        return None

    def engine_stats(self) -> dict:
        """Nothing in `LLMEngine.stats()`: the step costs are in `stats()` and `step_log`."""
        return {}

    def prepare(self, scheduled, plans: dict | None = None) -> None:
        """Before the forward: which rows of this step's logits belong to constrained requests, and start
        filling their masks (worker thread with overlap, else now)."""
        if self._pending is not None and isinstance(self._pending[1], Future):
            self._pending[1].exception()  # a step that failed after prepare: let its worker finish first
        self._pending = None
        if not self.matchers:
            return
        layout, jobs = [], []  # layout: (request id, rows) for every entry that samples, in the runner's order
        for req, n in scheduled:
            if req.num_computed_tokens + n != req.num_tokens:
                continue  # a prefill chunk that does not reach the end: no logits this step
            prop = (plans or {}).get(req.request_id)
            guesses = list(prop.token_ids) if prop is not None else []
            layout.append((req.request_id, len(guesses) + 1))
            m = self.matchers.get(req.request_id)
            if m is not None:
                jobs.append((req.request_id, m, guesses))
        if not jobs:
            return
        if self.overlap:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
            work: Future | dict = self._pool.submit(self._fill, jobs)
        else:
            work = self._fill(jobs)
        self._pending = (layout, work)

    def _fill(self, jobs) -> dict:
        t0 = time.perf_counter()
        xgr = self.compiler.xgr
        masks = {}
        for rid, m, guesses in jobs:
            bm = xgr.allocate_token_bitmask(len(guesses) + 1, self.vocab_size)  # all ones: terminated rows stay free
            n_ok = 0
            for i in range(len(guesses) + 1):
                if m.is_terminated():
                    break
                m.fill_next_token_bitmask(bm, i)
                if i < len(guesses):
                    if not m.accept_token(int(guesses[i])):
                        break  # the refused guess's row is filled; rows after it are never used
                    n_ok += 1
            if n_ok:
                m.rollback(n_ok)
            masks[rid] = bm & self.compiler.keep
        masks["__fill_ms__"] = (time.perf_counter() - t0) * 1e3
        return masks

    def apply(self, logits: torch.Tensor, to_sample) -> torch.Tensor:
        """After the forward: the constrained rows of `logits` go through the mask function."""
        if self._pending is None:
            return logits
        layout, work = self._pending
        self._pending = None
        t0 = time.perf_counter()
        masks = work.result() if isinstance(work, Future) else work
        t1 = time.perf_counter()
        fill_ms = masks.pop("__fill_ms__")
        order = [rid for rid, _ in layout]
        if order != [r.request_id for r in to_sample]:
            raise RuntimeError(f"structured outputs: rows planned for {order} but the runner returned "
                               f"{[r.request_id for r in to_sample]}; this is a bug")
        idx, rows = [], []
        r = 0
        for rid, n in layout:
            if rid in masks:
                idx.extend(range(r, r + n))
                rows.append(masks[rid])
                if rid in self.record:
                    self.record[rid].append(masks[rid][0].clone())
            r += n
        bitmask = torch.cat(rows)
        index = torch.tensor(idx, device=logits.device)
        masked = self.mask_fn(logits[index], bitmask)
        if masked is None or tuple(masked.shape) != (len(idx), logits.shape[-1]):
            raise ValueError(f"the mask function must return the masked logits [{len(idx)}, {logits.shape[-1]}], "
                             f"got {None if masked is None else tuple(masked.shape)}")
        masked = self._no_empty_rows(masked, layout, masks)
        with torch.inference_mode():  # the runner's logits are inference tensors: written in place, no copy
            logits[index] = masked.to(logits.dtype)
        t2 = time.perf_counter()
        inline = not isinstance(work, Future)  # filled before the forward, on the step's own thread
        self.step_log.append({"rows": len(idx), "fill_ms": fill_ms, "wait_ms": (t1 - t0) * 1e3,
                              "apply_ms": (t2 - t1) * 1e3, "accept_ms": 0.0, "inline_ms": fill_ms if inline else 0.0})
        return logits

    def _no_empty_rows(self, masked: torch.Tensor, layout, masks) -> torch.Tensor:
        """A row where the grammar allows nothing (a schema that cannot be completed) would make the sampler
        divide by zero and fail the whole step: that row gets the stop token instead, and its request is marked
        so `accept` ends it alone with `DEAD_END`."""
        dead = torch.isneginf(masked).all(-1)
        if not bool(dead.any()):
            return masked
        rids = [rid for rid, n in layout if rid in masks for _ in range(n)]
        stop = self.stop_token_ids[0] if self.stop_token_ids else 0
        masked = masked.clone()
        for i in dead.nonzero().flatten().tolist():
            self.dead_ends.add(rids[i])
            masked[i] = float("-inf")
            masked[i, stop] = 0.0
        return masked

    def accept(self, req, token: int) -> str | None:
        """Advance the request's matcher by one emitted token. Returns a finish reason when the grammar is
        complete ("stop"), left no token (`DEAD_END`) or refused the token (an error that ends only this
        request), else None."""
        m = self.matchers.get(req.request_id)
        if m is None:
            return None
        if req.request_id in self.dead_ends:
            self.dead_ends.discard(req.request_id)
            return DEAD_END
        t0 = time.perf_counter()
        ok = self.advance_fn(m, [int(token)])
        if self.step_log:
            self.step_log[-1]["accept_ms"] += (time.perf_counter() - t0) * 1e3
        if not ok:
            text = self.tokenizer.decode([int(token)]) if self.tokenizer is not None else ""
            return f"error: the grammar refused token {int(token)} ({text!r}): the mask let it through"
        return "stop" if m.is_terminated() else None

    # -- cost ---------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Per constrained step (medians, ms): filling masks, waiting for them after the forward, applying
        them, advancing matchers, and `exposed_ms` = what the step's critical path paid for all of it."""
        log = self.step_log
        if not log:
            return {"structured_steps": 0}

        def med(key):
            vals = sorted(key(e) for e in log)
            return vals[len(vals) // 2]

        return {
            "structured_steps": len(log),
            "structured_overlap": self.overlap,
            "mask_fill_ms": med(lambda e: e["fill_ms"]),
            "mask_wait_ms": med(lambda e: e["wait_ms"]),
            "mask_apply_ms": med(lambda e: e["apply_ms"]),
            "matcher_accept_ms": med(lambda e: e["accept_ms"]),
            "mask_exposed_ms": med(exposed_ms),
        }


def exposed_ms(entry: dict) -> float:
    """Time a step's critical path spent on grammar work: filling inline (no overlap) or waiting for the
    worker (overlap), plus applying the masks and advancing the matchers."""
    return entry["inline_ms"] + entry["wait_ms"] + entry["apply_ms"] + entry["accept_ms"]
