"""Checks for lab 16's exercises: the paged decode kernel and its split-KV variant, against
`paged_attention_reference` on random block tables, ragged contexts, grouped-query ratios and partly filled last
blocks; then the engine part is saved (`lab_utils.kernels.learner_kernel`). And the lab's claims.

A rejection names the part, its file in my_engine/ and the case; where the output equals a known wrong kernel's
(computed here in PyTorch from the case), it names that mistake. It never shows the reference code. Without
Triton the checks print "skipped: needs triton" and pass nothing.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable

import torch

from lab_utils.checks.claims import Claim
from lab_utils.engine.attention import paged_attention_reference
from lab_utils.kernels import triton_env
from lab_utils.kernels.decode_cases import DecodeCase, random_case

ATOL = RTOL = 2e-4
PART_FILE = "my_engine/kernel.py"


# --- known wrong kernels, as PyTorch on the case ------------------------------------------------------------
def _ref(case: DecodeCase, q=None, k=None, v=None, tables=None, ctx=None) -> torch.Tensor:
    return paged_attention_reference(case.q if q is None else q, case.k_cache if k is None else k,
                                     case.v_cache if v is None else v, case.tables if tables is None else tables,
                                     case.context_lens if ctx is None else ctx, [1] * len(case.tables),
                                     case.block_size)


def tail_unmasked(case: DecodeCase) -> torch.Tensor:
    """Every slot of the last block attended to, filled or not."""
    return _ref(case, ctx=[len(t) * case.block_size for t in case.tables])


def kv_head_modulo(case: DecodeCase) -> torch.Tensor:
    """Query head h read KV head h % Hkv (interleaved) instead of h // group (neighbours share one)."""
    hq, hkv = case.q.shape[1], case.k_cache.shape[1]
    heads = [h % hkv for h in range(hq)]
    return _ref(case, k=case.k_cache[:, heads], v=case.v_cache[:, heads])


def table_ignored(case: DecodeCase) -> torch.Tensor:
    """Logical block j read from physical block j: the block table skipped."""
    return _ref(case, tables=[list(range(len(t))) for t in case.tables])


def table_offset(case: DecodeCase) -> torch.Tensor:
    """Every sequence read the block table of sequence 0 (no row offset into the table)."""
    width = len(case.tables[0])
    tables = [(case.tables[0] + [0] * max(0, len(t) - width))[:len(t)] for t in case.tables]
    return _ref(case, tables=tables)


def no_scale(case: DecodeCase) -> torch.Tensor:
    """Softmax of q.k without the 1/sqrt(d) scale."""
    return _ref(case, q=case.q * math.sqrt(case.q.shape[-1]))


def split_slices(case: DecodeCase, num_splits: int) -> list[tuple[int, int]]:
    """The contract's slices: split s covers blocks [s * per, (s + 1) * per), per = ceil(max_blocks / num_splits)."""
    width = max(len(t) for t in case.tables)
    per = max(1, -(-width // num_splits))
    return [(s * per, (s + 1) * per) for s in range(-(-width // per))]


def _split_outputs(case: DecodeCase, num_splits: int) -> list[list[torch.Tensor | None]]:
    """Per sequence, per split: the normalised attention over that slice [Hq, D] (None for an empty slice)."""
    bs, out = case.block_size, []
    for i, (table, ctx) in enumerate(zip(case.tables, case.context_lens)):
        row = []
        for lo, hi in split_slices(case, num_splits):
            start, end = lo * bs, min(hi * bs, ctx)
            if start >= end:
                row.append(None)
                continue
            slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(start, end)])
            k, v = case.k_cache[slots].float(), case.v_cache[slots].float()
            group = case.q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            w = (torch.einsum("hd,khd->hk", case.q[i].float(), k) * case.scale).softmax(-1)
            row.append(torch.einsum("hk,khd->hd", w, v))
        out.append(row)
    return out


def split_mean(case: DecodeCase, num_splits: int) -> torch.Tensor:
    """The slices' outputs averaged (each slice the same weight), not weighted by their log-sum-exps."""
    rows = [torch.stack([o for o in row if o is not None]).mean(0) for row in _split_outputs(case, num_splits)]
    return torch.stack(rows).to(case.q.dtype)


def split_mean_all(case: DecodeCase, num_splits: int) -> torch.Tensor:
    """The same, dividing by every split, empty ones too."""
    outs = _split_outputs(case, num_splits)
    rows = [sum(o for o in row if o is not None) / len(row) for row in outs]
    return torch.stack(rows).to(case.q.dtype)


@dataclass(frozen=True)
class Mistake:
    id: str
    output: Callable  # (case) -> the wrong kernel's output, or (case, num_splits) for split mistakes
    text: str
    split: bool = False


MISTAKES = [
    Mistake("tail_not_masked", tail_unmasked,
            "the last block's empty slots took part: mask positions at or past context_len (scores to -inf "
            "before the max, loads masked)"),
    Mistake("wrong_kv_head", kv_head_modulo,
            "query head h read KV head h % num_kv_heads; with grouped-query attention neighbouring query heads "
            "share one KV head: h // (num_q_heads // num_kv_heads)"),
    Mistake("table_ignored", table_ignored,
            "logical block j was read from physical block j: look up its id in the sequence's block table"),
    Mistake("table_row_offset", table_offset,
            "every sequence read the first sequence's block table: offset into the table by its row stride"),
    Mistake("missing_scale", no_scale, "the scores were not multiplied by scale (1/sqrt(head_dim))"),
    Mistake("split_without_lse", split_mean,
            "the splits' outputs were averaged; weigh each by exp(its lse - the largest lse), normalised", True),
    Mistake("split_without_lse_all", split_mean_all,
            "the splits' outputs were averaged over every split; weigh each by exp(its lse - the largest lse), "
            "normalised (an empty split weighs 0)", True),
]
NO_MAX = ("a score of ~1e3 overflowed exp(): subtract the running max before exp() and rescale the running sum "
          "and accumulator when the max grows (online softmax)")


def diagnose(case: DecodeCase, got: torch.Tensor, num_splits: int | None = None) -> str | None:
    """The id and text of the known mistake whose output `got` equals on `case`, or None."""
    want = case.expected()
    if not torch.isfinite(got).all() and torch.isfinite(want).all() and case.q.abs().max() > 50:
        return f"no_max_subtraction: {NO_MAX}"
    for m in MISTAKES:
        if m.split and num_splits is None:
            continue
        wrong = m.output(case, num_splits) if m.split else m.output(case)
        if not torch.allclose(wrong, want, atol=ATOL, rtol=RTOL) and \
                torch.allclose(got.double(), wrong.double(), atol=ATOL, rtol=RTOL):
            return f"{m.id}: {m.text}"
    return None


# --- the cases ----------------------------------------------------------------------------------------------
def cases(seed: int, n: int) -> list[tuple[str, DecodeCase]]:
    """Named cases: a plain one, one per shape a mistake needs (GQA with a tail, several sequences, large
    scores), then random ones."""
    rng = random.Random(seed)
    fixed = [("plain", random_case(rng, heads=(2, 2), batch=1, block_size=4, max_context=10)),
             ("grouped-query heads and a partly filled last block", random_case(rng, heads=(4, 2), batch=2)),
             ("several sequences with shuffled tables", random_case(rng, heads=(6, 2), batch=3, max_context=40)),
             ("large scores (online softmax)", random_case(rng, heads=(4, 2), batch=2, scale_q=300.0))]
    return fixed + [(f"random {i}", random_case(rng)) for i in range(max(0, n - len(fixed)))]


def _reject(name: str, what: str, case: DecodeCase, detail: str, mistake: str | None) -> AssertionError:
    text = f"your {name} ({PART_FILE} once it passes) failed on the {what} case ({case.describe()}): {detail}"
    return AssertionError(text + (f"\nlikely mistake: {mistake}" if mistake else ""))


def _check_outputs(name: str, fn: Callable, n: int, seed: int | None, num_splits: tuple = (None,)) -> int:
    from lab_utils.checks.lab00 import compare

    seed = random.randrange(1 << 30) if seed is None else seed
    count = 0
    for what, case in cases(seed, n):
        for splits in num_splits:
            got = _call(fn, case.args() if splits is None else (*case.args(), splits))
            try:
                compare(name, got, case.expected(), dims="seq,head,dim", atol=ATOL, rtol=RTOL)
            except AssertionError as err:
                mistake = diagnose(case, got, splits) if isinstance(got, torch.Tensor) and \
                    got.shape == case.q.shape else None
                what_s = what if splits is None else f"{what}, num_splits={splits}"
                raise _reject(name, what_s, case, str(err), mistake) from None
            count += 1
    return count


def _call(fn: Callable, args: tuple):
    """fn(*args); a `NotImplementedError` raised inside a kernel (Triton's interpreter wraps it) comes out as
    itself, so an unwritten exercise stops at its hint."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except Exception as err:
        if isinstance(err.__cause__, NotImplementedError):
            raise err.__cause__ from None
        if "raise NotImplementedError(" in str(err):  # compiled Triton cannot compile the exercise's placeholder
            raise NotImplementedError(_placeholder_hint(str(err))) from None
        raise


def _placeholder_hint(message: str) -> str:
    """The text of the exercise's `raise NotImplementedError("...")` quoted in a Triton compile error."""
    import re

    m = re.search(r'raise NotImplementedError\((["\'])(.*?)\1\)', message)
    return m.group(2) if m else "the kernel is not written yet: replace its raise NotImplementedError(...)"


def check_paged_decode(launcher: Callable, kernel=None, cases_n: int = 6, seed: int | None = None) -> bool:
    """Your launcher (it runs your `@triton.jit` kernel) against the reference; then saved as the engine's part
    `kernel.paged_decode` with the kernel. False (and a printed line) without Triton."""
    if not _have_triton():
        return False
    n = _check_outputs("kernel.paged_decode", launcher, cases_n, seed)
    print(f"check_paged_decode passed ({n} cases: grouped-query heads, partly filled last blocks, shuffled "
          f"block tables, large scores)")
    _save("kernel.paged_decode", launcher, kernel)
    return True


def check_paged_decode_split(launcher: Callable, kernel=None, combine=None, cases_n: int = 5,
                             seed: int | None = None, num_splits: tuple = (2, 3)) -> bool:
    """Your split-KV launcher at several `num_splits` (some past a short context's block count) against the
    reference; then saved as `kernel.paged_decode_split`."""
    if not _have_triton():
        return False
    n = _check_outputs("kernel.paged_decode_split", launcher, cases_n, seed, num_splits)
    print(f"check_paged_decode_split passed ({n} case x num_splits runs)")
    _save("kernel.paged_decode_split", launcher, kernel, combine)
    return True


def _have_triton() -> bool:
    triton, why = triton_env.load()
    if triton is None:
        print(why)
    return triton is not None


def _save(name: str, launcher: Callable, kernel, helper=None) -> None:
    from lab_utils.kernels import learner_kernel

    learner_kernel.save(name, launcher, tuple(k for k in (kernel,) if k is not None),
                        tuple(h for h in (helper,) if h is not None))


# --- the engine with the kernel -----------------------------------------------------------------------------
def engine_run(model, parts=None, use_kernel: bool = True, prompts=None, max_tokens: int = 6,
               block_size: int = 4) -> dict:
    """One greedy float32 run of the engine as of lab 04 (its decode steps through `parts`' kernel.paged_decode,
    the reference Triton kernel where `parts` has none; `use_kernel=False`: the engine's own attention):
    {tokens, logprobs, kernel_steps, seconds}."""
    import time

    from lab_utils.course import learner_parts
    from lab_utils.engine.engine import LLMEngine
    from lab_utils.engine.sampling_params import SamplingParams
    from lab_utils.kernels.engine_attention import run_kernel_in

    prompts = prompts or [[1, 2, 3, 4, 5, 6, 7], list(range(20, 38)), [42] * 5]
    engine = LLMEngine(model, learner_parts.engine_config("04", block_size=block_size, num_gpu_blocks=64),
                       dtype=torch.float32, parts=parts)
    paths = run_kernel_in(engine) if use_kernel else None
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                   logprobs=0), use_tqdm=False)
    return {"tokens": [o.token_ids for o in outs], "seconds": time.perf_counter() - t0,
            "logprobs": [[lp.logprob for lp in o.logprobs] for o in outs],
            "kernel_steps": paths.kernel_steps if paths else 0}


def check_kernel_in_engine(model, parts=None, **kw) -> dict:
    """The engine with the kernel against the engine without it on the same prompts: identical greedy tokens,
    logprobs within 1e-4 (float32), and the kernel took the decode steps. Returns both runs."""
    ref = engine_run(model, None, use_kernel=False, **kw)
    you = engine_run(model, parts, use_kernel=True, **kw)
    if you["kernel_steps"] == 0:
        raise AssertionError("the engine never called the decode kernel: no decode-only step ran")
    if you["tokens"] != ref["tokens"]:
        raise AssertionError(f"kernel.paged_decode ({PART_FILE}) in the engine: greedy tokens {you['tokens']} but "
                             f"the reference engine gives {ref['tokens']}")
    worst = max(abs(a - b) for x, y in zip(you["logprobs"], ref["logprobs"]) for a, b in zip(x, y))
    if worst > 1e-4:
        raise AssertionError(f"kernel.paged_decode ({PART_FILE}) in the engine: token logprobs differ from the "
                             f"reference engine's by up to {worst:.3g} (float32 allows 1e-4)")
    print(f"check_kernel_in_engine passed: {sum(map(len, you['tokens']))} tokens equal to the reference engine's, "
          f"{you['kernel_steps']} decode steps through the kernel, logprobs within {worst:.1g}")
    return {"reference": ref, "kernel": you, "logprob_diff": worst}


# --- the lab's claims ---------------------------------------------------------------------------------------
def claims(r: dict) -> list[Claim]:
    """Lab 16's claims from the run's measurements `r` (built in the claims cell).

    `tokens_equal`: the engine with your kernel gave the reference engine's greedy tokens (float32);
    `kernel_calls`: how often the engine called your kernel in that run; `bound_fraction`: per attention path
    (yours, engine, sdpa_dense), the measured fraction of the KV-bytes bound at the largest grid point;
    `bytes_per_flop`: decode attention's bytes per FLOP from the arithmetic; `ridge_bytes_per_flop`: the
    machine's bytes/FLOP at its ridge; `trace_rows`: the profiler timeline's rows (host, device) with events;
    `bench_line`: the line `python -m lab_utils bench-kernel` printed (None when it printed none)."""
    from lab_utils.checks.claims import need

    need(r, "tokens_equal", "kernel_calls", "bound_fraction", "bytes_per_flop", "ridge_bytes_per_flop",
         "trace_rows", "bench_line")
    frac, line = r["bound_fraction"], r["bench_line"] or {}
    return [
        (f"the engine's greedy tokens with your kernel equal the reference engine's "
         f"({r['kernel_calls']} kernel calls)", bool(r["tokens_equal"]) and r["kernel_calls"] > 0),
        (f"decode attention reads {r['bytes_per_flop']:.2f} bytes per FLOP, more than the machine's ridge "
         f"({r['ridge_bytes_per_flop']:.3f}): it is bound by bytes", r["bytes_per_flop"] > r["ridge_bytes_per_flop"]),
        ("every attention path stays under the KV-bytes bound (" + ", ".join(
            f"{k} {v:.3g}" for k, v in frac.items()) + " of it)", all(0 < v <= 1.0 for v in frac.values())),
        (f"the profiler trace has events on {', '.join(r['trace_rows']) or 'no row'}",
         "host" in r["trace_rows"]),
        (f"bench-kernel, in its own process, found your saved kernel correct ({line.get('error') or 'no error'}; "
         f"{line.get('us_per_call')} µs per call on {line.get('device')})", line.get("correct") is True),
    ]


def assert_claims(r: dict, show: bool = True) -> None:
    """Print lab 16's claims; AssertionError naming each one that fails."""
    from lab_utils.checks.claims import report

    report(claims(r), show)


from lab_utils.workshop.records import record_checks  # noqa: E402

record_checks(globals())
