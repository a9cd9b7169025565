"""What a prefill costs on this device, fitted from timed prefills, and what skipping cached tokens saves.

TTFT = a + b x prompt tokens: a is what a step costs whatever its size (kernel launches, scheduling), b what a
prompt token costs. A CPU is mostly b, so a prefix-cache hit saves most of a prompt's prefill; a small model on a
GPU is mostly a (launch-bound), so a hit saves little time there.
"""
from __future__ import annotations


def prefill_cost_fit(prompt_lens: list[int], ttfts_s: list[float]) -> tuple[float, float]:
    """(a, b) of TTFT = a + b x prompt tokens, least squares over prefills timed alone (TTFT is then the prefill)
    at lengths far apart. a is what a step costs whatever its size (kernel launches, scheduling), b what a prompt
    token costs on this device: a CPU is mostly b; a small model on a GPU is mostly a (launch-bound)."""
    n = len(prompt_lens)
    if n < 2 or len(ttfts_s) != n:
        raise ValueError(f"need a TTFT for each of >= 2 prompts, got {n} prompts and {len(ttfts_s)} TTFTs")
    mx, my = sum(prompt_lens) / n, sum(ttfts_s) / n
    sxx = sum((x - mx) ** 2 for x in prompt_lens)
    b = sum((x - mx) * (y - my) for x, y in zip(prompt_lens, ttfts_s)) / sxx if sxx else 0.0
    a = my - b * mx
    if a < 0:  # attention makes long prefills super-linear: a line through the origin instead
        a, b = 0.0, sum(x * y for x, y in zip(prompt_lens, ttfts_s)) / sum(x * x for x in prompt_lens)
    elif b < 0:  # timing noise on a flat, launch-bound cost: no per-token cost
        a, b = my, 0.0
    return a, b


def predicted_ttft_cut(fit: tuple[float, float], prompt_lens: list[int], cached: list[int]) -> float:
    """The share of mean TTFT prefix caching should save, from the fitted costs: a hit skips its tokens' b, never
    the step's a (at least one token is always computed)."""
    a, b = fit
    off = sum(a + b * n for n in prompt_lens)
    on = sum(a + b * max(1, n - c) for n, c in zip(prompt_lens, cached))
    return 1 - on / off if off > 0 else 0.0
