"""Checks for lab 08's exercise: goodput from raw per-request timings.

The learner writes `goodput(requests, duration_s, slo_ttft_ms, slo_tpot_ms)`: requests per second that met
every SLO. Each request has `arrival_time` and `token_times` (seconds, one timestamp per output token).
The check runs it on fresh random runs that include the awkward cases (a request exactly at the SLO, a
one-token request with no TPOT, a request that produced nothing, an SLO left out) and compares with the
reference in `lab_utils.bench.metrics`. On a difference it says which run, expected vs got, and a diagnosis
when the wrong number matches a known mistake. It never shows the solution.
"""
from __future__ import annotations

import math
import numbers
import random
from collections.abc import Callable

from lab_utils.bench.metrics import RequestTimes, meets_slo


def reference_goodput(requests, duration_s: float, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> float:
    good = sum(1 for r in requests if r.token_times and meets_slo(r, slo_ttft_ms, slo_tpot_ms))
    return good / duration_s


def random_run(rng: random.Random, n: int = 12, slo_ttft_ms: float | None = 250.0,
               slo_tpot_ms: float | None = 62.5) -> list[RequestTimes]:
    reqs = []
    for i in range(n):
        arrival = round(rng.uniform(0, 2.0), 3)
        kind = rng.random()
        if i == 0 or kind < 0.08:  # produced nothing (rejected / failed)
            reqs.append(RequestTimes(arrival, []))
            continue
        ttft = rng.choice([0.05, 0.1, 0.2, 0.25, 0.4, 0.8, 1.5]) * rng.uniform(0.8, 1.2)
        n_out = 1 if (i == 1 or kind < 0.16) else rng.randint(2, 40)
        gaps = [rng.choice([0.02, 0.04, 0.06, 0.12]) * rng.uniform(0.5, 1.5) for _ in range(n_out - 1)]
        t = arrival + ttft
        times = [t]
        for g in gaps:
            t += g
            times.append(t)
        reqs.append(RequestTimes(arrival, times))
    # one request sitting exactly on both SLOs (exact in binary floating point): it meets them ("<=")
    a, t1, g = 1.0, (slo_ttft_ms or 250.0) / 1e3, (slo_tpot_ms or 62.5) / 1e3
    reqs.append(RequestTimes(a, [a + t1, a + t1 + g, a + t1 + 2 * g]))
    rng.shuffle(reqs)
    return reqs


def _mistakes(reqs, dur, ttft_ms, tpot_ms) -> dict[str, float]:
    """Numbers a plausible wrong solution returns, with what would explain them."""
    done = [r for r in reqs if r.token_times]

    def ok(r, check_ttft=True, check_tpot=True, strict=False, tpot_over_all=False, nan_fails=False):
        ttft = (r.token_times[0] - r.arrival_time) * 1e3
        n = len(r.token_times)
        if tpot_over_all:
            tpot = (r.token_times[-1] - r.arrival_time) / n * 1e3
        else:
            tpot = (r.token_times[-1] - r.token_times[0]) / (n - 1) * 1e3 if n > 1 else math.nan
        if check_ttft and ttft_ms is not None and (ttft >= ttft_ms if strict else ttft > ttft_ms):
            return False
        if check_tpot and tpot_ms is not None:
            if math.isnan(tpot):
                return not nan_fails
            if tpot >= tpot_ms if strict else tpot > tpot_ms:
                return False
        return True

    def rate(pred, pool=done) -> float:
        return sum(1 for r in pool if pred(r)) / dur

    return {
        "counted every completed request, SLO or not (that is request throughput, not goodput)": len(done) / dur,
        "returned a count or a share instead of requests per second (divide the good requests by duration_s)":
            sum(1 for r in done if ok(r)),
        "checked only the TTFT SLO; a request must also meet the TPOT SLO": rate(lambda r: ok(r, check_tpot=False)),
        "checked only the TPOT SLO; a request must also meet the TTFT SLO": rate(lambda r: ok(r, check_ttft=False)),
        "a request exactly at the SLO counts as meeting it (use <=, not <)": rate(lambda r: ok(r, strict=True)),
        "TPOT is the time per output token after the first: (last - first) / (n - 1), not E2E / n":
            rate(lambda r: ok(r, tpot_over_all=True)),
        "a one-token request has no TPOT, so the TPOT SLO cannot fail it": rate(lambda r: ok(r, nan_fails=True)),
        "a request with no tokens never meets an SLO": rate(ok, done) + (len(reqs) - len(done)) / dur,
        "returned the share of requests meeting the SLO (slo_attainment); goodput is per second":
            sum(1 for r in done if ok(r)) / max(len(done), 1),
    }


def check_goodput(fn: Callable, seed: int | None = None, runs: int = 6) -> None:
    """Raise AssertionError naming the first run where `fn` differs from the reference; print one line if all agree."""
    rng = random.Random(seed if seed is not None else random.randrange(1 << 30))
    # SLOs exact in binary (x / 1000 and back lands on the same float), so "exactly at the SLO" is testable
    slos = [(250.0, 62.5), (250.0, None), (None, 62.5), (500.0, 125.0), (125.0, 31.25), (1000.0, 125.0)]
    for k in range(runs):
        ttft_ms, tpot_ms = slos[k % len(slos)]
        reqs = random_run(rng, slo_ttft_ms=ttft_ms, slo_tpot_ms=tpot_ms)
        dur = round(rng.uniform(2.5, 6.0), 3)
        want = reference_goodput(reqs, dur, ttft_ms, tpot_ms)
        got = fn(reqs, dur, ttft_ms, tpot_ms)  # NotImplementedError propagates: the learner sees the hint
        if isinstance(got, bool) or not isinstance(got, numbers.Real):
            raise AssertionError(f"goodput must return a number (requests per second), got {type(got).__name__}: {got!r}")
        if not math.isclose(float(got), want, rel_tol=1e-9, abs_tol=1e-12):
            why = [m for m, v in _mistakes(reqs, dur, ttft_ms, tpot_ms).items() if math.isclose(v, float(got), rel_tol=1e-9)]
            hint = f" Likely cause: {why[0]}." if why else ""
            raise AssertionError(
                f"run {k}: {len(reqs)} requests over duration_s={dur}, slo_ttft_ms={ttft_ms}, slo_tpot_ms={tpot_ms}: "
                f"expected goodput {want:.4f} req/s, got {float(got):.4f}.{hint}")
    print(f"check_goodput passed: {runs} random runs (SLO edges, one-token and empty requests, missing SLOs)")
