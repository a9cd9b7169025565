"""The course's serving metrics, from per-token timestamps. Definitions follow vLLM's `bench serve`.

For one request (times in seconds on one monotonic clock):
- TTFT  time to first token  = first_token_time - arrival_time   (queueing + prefill)
- ITL   inter-token latency  = gaps between consecutive output tokens (one value per gap)
- TPOT  time per output token = (finish_time - first_token_time) / (n_out - 1)   (mean ITL of that request)
- E2EL  end-to-end latency   = finish_time - arrival_time
Over a run: output throughput = output tokens / duration; request throughput = requests / duration;
goodput = requests that met every SLO / duration (a fast server that misses its SLOs has low goodput).
Each latency is reported as mean, median, std and p90/p99 in milliseconds (`mean_ttft_ms`, `p99_itl_ms`, ...).

A request is anything with `arrival_time`, `token_times` (one timestamp per output token) and optionally
`first_token_time`, `finish_time`, `num_prompt_tokens` (the engine's `RequestMetrics` has these names).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class RequestTimes:
    arrival_time: float
    token_times: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if self.token_times:
            self.first_token_time = self.token_times[0] if self.first_token_time is None else self.first_token_time
            self.finish_time = self.token_times[-1] if self.finish_time is None else self.finish_time


def _first(r) -> float:
    t = getattr(r, "first_token_time", None)
    if t is None:
        if not r.token_times:
            raise ValueError("request has no output tokens, so it has no TTFT")
        t = r.token_times[0]
    return t


def _finish(r) -> float:
    t = getattr(r, "finish_time", None)
    if t is None:
        if not r.token_times:
            raise ValueError("request has no output tokens and no finish_time")
        t = r.token_times[-1]
    return t


def ttft(r) -> float:
    return _first(r) - r.arrival_time


def itls(r) -> list[float]:
    t = list(r.token_times)
    return [b - a for a, b in zip(t, t[1:])]


def tpot(r) -> float:
    """Mean time per output token after the first; NaN for a one-token request (vLLM leaves it out)."""
    n = len(r.token_times)
    return (_finish(r) - _first(r)) / (n - 1) if n > 1 else math.nan


def e2el(r) -> float:
    return _finish(r) - r.arrival_time


def meets_slo(r, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> bool:
    if slo_ttft_ms is not None and ttft(r) * 1e3 > slo_ttft_ms:
        return False
    tp = tpot(r)
    if slo_tpot_ms is not None and not math.isnan(tp) and tp * 1e3 > slo_tpot_ms:
        return False
    return True


def _percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    xs = sorted(xs)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


PERCENTILES = (90, 99)  # besides the median; vLLM's `bench serve` default is p99
METRICS = ("ttft", "tpot", "itl", "e2el")


def _stats(name: str, xs_seconds: Iterable[float], out: dict, percentiles: Sequence[float] = PERCENTILES) -> None:
    xs = [x * 1e3 for x in xs_seconds if not math.isnan(x)]
    out[f"mean_{name}_ms"] = statistics.fmean(xs) if xs else math.nan
    out[f"median_{name}_ms"] = statistics.median(xs) if xs else math.nan
    out[f"std_{name}_ms"] = statistics.pstdev(xs) if xs else math.nan
    for q in percentiles:
        out[f"p{q:g}_{name}_ms"] = _percentile(xs, q)


def summarize(
    requests: Sequence,
    duration: float | None = None,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    percentiles: Sequence[float] = PERCENTILES,
) -> dict:
    """One dict with vLLM `bench serve` key names. `duration` defaults to first arrival -> last finish.

    Requests without output tokens (aborted, rejected, failed) are not `completed` and count in no latency.
    `request_goodput` (requests meeting every given SLO per second) and `slo_attainment` (their share) are
    None when no SLO is given, as in vLLM.
    """
    done = [r for r in requests if r.token_times]
    if not done:
        raise ValueError(f"none of the {len(requests)} requests produced a token; nothing to summarize")
    if duration is None:
        duration = max(_finish(r) for r in done) - min(r.arrival_time for r in done)
    if duration <= 0:
        raise ValueError(f"duration={duration} s must be > 0")
    out_tokens = sum(len(r.token_times) for r in done)
    in_tokens = sum(getattr(r, "num_prompt_tokens", 0) or 0 for r in done)
    res = dict(
        completed=len(done),
        failed=len(requests) - len(done),
        duration=duration,
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        request_throughput=len(done) / duration,
        output_throughput=out_tokens / duration,
        total_token_throughput=(in_tokens + out_tokens) / duration,
    )
    _stats("ttft", (ttft(r) for r in done), res, percentiles)
    _stats("tpot", (tpot(r) for r in done), res, percentiles)
    _stats("itl", (x for r in done for x in itls(r)), res, percentiles)
    _stats("e2el", (e2el(r) for r in done), res, percentiles)
    res["request_goodput"] = res["slo_attainment"] = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in done)
        res["request_goodput"] = good / duration
        res["slo_attainment"] = good / len(done)
    res["slo_ttft_ms"], res["slo_tpot_ms"] = slo_ttft_ms, slo_tpot_ms
    return res


def per_request(requests: Sequence) -> dict:
    """Raw per-request values (seconds), as vLLM saves them with `--save-detailed`: for CDFs and re-analysis."""
    done = [r for r in requests if r.token_times]
    return dict(
        input_lens=[getattr(r, "num_prompt_tokens", 0) or 0 for r in done],
        output_lens=[len(r.token_times) for r in done],
        ttfts=[ttft(r) for r in done],
        tpots=[None if math.isnan(tpot(r)) else tpot(r) for r in done],
        e2els=[e2el(r) for r in done],
        itls=[itls(r) for r in done],
    )
