"""Timing decode steps so that a figure means its label: `batch` rows in every timed step.

A request gains at most one token a step, so requests whose `max_tokens` ends inside the timed window leave it,
and "tokens/s at batch 256" silently becomes the rate of a smaller batch. Here the requests outlive the window
(`window_tokens`), the engine's step log proves every timed step held `batch` decode rows, and the rate is
sum(rows) / sum(seconds). On CUDA the captured graph's replay is also timed alone (CUDA events): the GPU's part
of a step without the host's scheduling, sampling and copies.
"""
from __future__ import annotations

import random
import statistics
import time


def prompts_of(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """`n` prompts of random token ids (seeded) with lengths cycling through `lengths`."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def window_tokens(budget: int, batch: int, prompt_len: int, steps: int, warm: int = 2) -> int:
    """max_tokens that outlives a timed window: a request gains at most one token a step, and the prefills take at
    most ceil(batch x prompt_len / (token budget - batch)) + 1 steps (decode rows take their share first)."""
    prefill = -(-batch * prompt_len // (budget - batch)) + 1 if budget > batch else batch * prompt_len
    return prefill + warm + steps + 8


def decode_window(eng, batch: int, prompt_len: int, steps: int, warm: int = 2, replays: int = 50,
                  around=None) -> dict:
    """Time `steps` pure decode steps of `batch` running requests (prefills done, `warm` steps untimed).

    Every request is long enough to outlive the timed window (`window_tokens`); the step log proves it: each
    timed step must hold `batch` decode rows. The requests are aborted after the window. Returns the seconds and
    rows of each timed step, the token rate sum(rows) / sum(seconds), and the graph replay alone on CUDA.
    `around`: a context manager entered around the timed steps alone (a profiler)."""
    import contextlib

    from lab_utils import SamplingParams
    from lab_utils.device import synchronize

    max_tokens = window_tokens(eng.config.max_num_batched_tokens, batch, prompt_len, steps, warm)
    ids = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
           for p in prompts_of(batch, [prompt_len])]
    prefill_steps = 0
    while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()
        prefill_steps += 1
    for _ in range(warm):
        eng.step()
    times = []
    first = len(eng.step_log)
    with around if around is not None else contextlib.nullcontext():
        for _ in range(steps):
            synchronize(eng.device)
            t0 = time.perf_counter()
            eng.step()
            synchronize(eng.device)
            times.append(time.perf_counter() - t0)
    log = eng.step_log[first:]
    rows = [len(e["requests"]) for e in log]
    mixed = [e["step"] for e in log if any(n != 1 for _, n in e["requests"]) or e["preempted"]]
    if len(log) != steps or any(r != batch for r in rows) or mixed:
        raise AssertionError(f"timed steps are not all {batch} decode rows: rows {rows}, mixed/preempted steps "
                             f"{mixed} (prefill took {prefill_steps} steps, max_tokens {max_tokens})")
    context = statistics.mean(eng.requests[i].num_tokens for i in ids) - steps / 2  # mean over the window
    out = {"seconds": times, "rows": rows, "tokens_per_s": sum(rows) / sum(times), "step_s": statistics.median(times),
           "prefill_steps": prefill_steps, "max_tokens": max_tokens, "mean_context": context}
    out["replay_s"] = graph_replay_seconds(eng, batch, max(eng.requests[i].num_tokens for i in ids) - 1, replays)
    for i in ids:
        eng.abort(i)
    while eng.has_unfinished():
        eng.step()
    return out


def graph_replay_seconds(eng, batch: int, context: int, replays: int = 50) -> float | None:
    """On CUDA: seconds of one replay of the graph the timed steps replayed, alone (CUDA events around
    `replays` back-to-back replays; no scheduling, sampling or host work). None without captured graphs.
    A replay rewrites the same K/V into the same slots, so the requests' caches do not change."""
    import torch

    from lab_utils.engine.accel.cuda_graphs import bucket_for, context_bucket

    g = eng.runner.graphs
    if g is None or not g.capture:
        return None
    e = g.entries.get((bucket_for(batch, g.buckets), context_bucket(context, eng.block_size, eng.max_model_len)))
    if e is None or e.graph is None:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e.graph.replay()
    start.record()
    for _ in range(replays):
        e.graph.replay()
    end.record()
    torch.cuda.synchronize(eng.device)
    return start.elapsed_time(end) / 1e3 / replays
