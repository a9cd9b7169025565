"""When copying a KV block back beats recomputing it: measured here, and from datasheet numbers for a GPU.

Copying a block back costs its bytes over the host link; recomputing it costs a prefill of its tokens. Both are
measured on this machine (`copy_bandwidth`, `prefill_curve`: fresh prompts, and tails over a cached history) and
predict a turn's time to first token (`predict_ttft`): the prefill of the tokens left to compute plus the copies. `per_token` does the same
arithmetic for a model's shape on a datasheet's link and peak (`H200_PCIE5`).
"""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from lab_utils.engine.engine import copy_block_in, copy_block_out
from lab_utils.engine.sampling_params import SamplingParams

# NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): host link PCIe Gen5 x16, "128 GB/s" (both
# directions together: 64 GB/s each way); BF16 Tensor Core 1,979 TFLOPS *with sparsity*, so 989 TFLOPS dense;
# HBM3e 4.8 TB/s. A prefill rarely runs near peak: MFU 0.5 is this module's assumption, not a datasheet figure.
H200_PCIE5 = {"link_bytes_per_s": 64e9, "peak_flops": 989e12, "mfu": 0.5}


def copy_bandwidth(engine, blocks: int = 16, repeats: int = 5) -> dict:
    """Host <-> device copy of whole KV blocks through the engine's own copies (the ones the host tier uses):
    bytes per second each way (medians over repeats) and bytes per block."""
    cache = engine.kv_cache
    ids = list(range(min(blocks, engine.num_blocks)))
    saved = [copy_block_out(cache, b) for b in ids]
    nbytes = sum(t.nbytes for t in saved[0].values())
    t_out, t_in = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        saved = [copy_block_out(cache, b) for b in ids]
        t1 = time.perf_counter()
        for b, s in zip(ids, saved):
            copy_block_in(cache, b, s)
        t2 = time.perf_counter()
        t_out.append(t1 - t0)
        t_in.append(t2 - t1)
    moved = nbytes * len(ids)
    return {"bytes_per_block": nbytes, "in_bytes_per_s": moved / statistics.median(t_in),
            "out_bytes_per_s": moved / statistics.median(t_out)}


def prefill_curve(engine, lengths: Sequence[int], repeats: int = 1, seed: int = 0,
                  context: int = 0) -> list[tuple[int, float]]:
    """Median time to first token of fresh prompts of each length (random ids: nothing cached), alone in `engine`.
    With `context` > 0, each prompt is a cached prefix of `context` tokens plus `n` fresh ones, the time is that
    of prefilling the fresh ones over the cached history (a returning turn's tail: its attention reads the whole
    history), and the curve's x is the tokens actually computed."""
    rng = random.Random(seed)
    vocab = engine.vocab_size
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    history = [rng.randrange(100, vocab) for _ in range(context)]
    if history:
        engine.generate([history], params)  # now in the prefix cache
    times: dict[int, list[float]] = {}
    for _ in range(repeats):
        for n in lengths:
            out = engine.generate([history + [rng.randrange(100, vocab) for _ in range(n)]], params)[0]
            if out.metrics.ttft is None:
                raise ValueError(f"a {context + n}-token prompt did not run in this engine ({out.finish_reason}): "
                                 f"measure lengths its KV pool holds")
            times.setdefault(len(out.prompt_token_ids) - out.num_cached_tokens, []).append(out.metrics.ttft)
    return sorted((n, statistics.median(ts)) for n, ts in times.items())


def prefill_seconds(curve: Sequence[tuple[int, float]]) -> Callable[[int], float]:
    """Seconds to prefill n tokens, read off the measured curve (linear between points, the last slope beyond)."""
    xs = np.array([n for n, _ in curve], dtype=float)
    ys = np.array([s for _, s in curve], dtype=float)
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else ys[0] / xs[0]

    def seconds(n: int) -> float:
        return float(np.interp(n, xs, ys)) if n <= xs[-1] else float(ys[-1] + slope * (n - xs[-1]))

    return seconds


def per_token_prefill_s(curve: Sequence[tuple[int, float]]) -> float:
    """The marginal prefill cost of one more token: the slope between the two longest measured prompts."""
    (n0, s0), (n1, s1) = curve[-2], curve[-1]
    return (s1 - s0) / (n1 - n0)


def predict_ttft(computed_tokens: int, blocks_in: int, prefill: Callable[[int], float], bytes_per_block: int,
                 in_bytes_per_s: float) -> float:
    """A turn's time to first token: prefill what is left, plus the copies back."""
    return prefill(max(computed_tokens, 1)) + blocks_in * bytes_per_block / in_bytes_per_s


def per_token(num_params: float, num_layers: int, num_kv_heads: int, head_dim: int, kv_bytes_per_value: int,
              link_bytes_per_s: float, peak_flops: float, mfu: float) -> dict:
    """One token's KV: bytes, seconds to copy it over the link, seconds to recompute it (2 * params FLOPs at
    `mfu` of peak; attention over the context left out, which only favours copying more)."""
    kv_bytes = 2 * num_layers * num_kv_heads * head_dim * kv_bytes_per_value
    copy_s = kv_bytes / link_bytes_per_s
    recompute_s = 2 * num_params / (peak_flops * mfu)
    return {"kv_bytes": kv_bytes, "copy_s": copy_s, "recompute_s": recompute_s, "copy_wins_by": recompute_s / copy_s}
