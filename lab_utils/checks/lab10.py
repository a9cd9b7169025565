"""Checks for lab 10's exercises: the roofline step time and goodput under an SLO.

Fresh random inputs each call, compared with `lab_utils.sim.cost_model` / `lab_utils.bench.metrics`; a mismatch
raises AssertionError with the input, expected vs returned, and a hint when the mistake is a common one.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable

from lab_utils.bench.metrics import RequestTimes, summarize


def check_roofline_time(fn: Callable[[float, float, float, float, float], float], seed: int | None = None) -> None:
    """`fn(flops, num_bytes, peak_flops, mem_bw, overhead_s) -> seconds`: max(compute, memory) + overhead."""
    rng = random.Random(seed)
    cases = [(1e12, 1e9, 1e15, 3e12, 0.0), (1e9, 16e9, 989e12, 3.35e12, 2e-3), (7e12, 15e9, 989e12, 3.35e12, 2e-3)]
    cases += [(10 ** rng.uniform(8, 14), 10 ** rng.uniform(6, 11), 10 ** rng.uniform(10, 15), 10 ** rng.uniform(9, 13),
               rng.choice([0.0, 1e-3, 0.05])) for _ in range(40)]
    for f, b, p, bw, oh in cases:
        exp = max(f / p, b / bw) + oh
        got = fn(f, b, p, bw, oh)
        if isinstance(got, (int, float)) and not isinstance(got, bool) and math.isclose(got, exp, rel_tol=1e-9):
            continue
        hint = ""
        if isinstance(got, (int, float)):
            if math.isclose(got, f / p + b / bw + oh, rel_tol=1e-9):
                hint = "compute and memory traffic overlap: take the max of the two times, not their sum"
            elif math.isclose(got, max(f / p, b / bw), rel_tol=1e-9):
                hint = "add the fixed per-step overhead"
            elif math.isclose(got, min(f / p, b / bw) + oh, rel_tol=1e-9):
                hint = "the slower of the two limits the step: max, not min"
        raise AssertionError(f"roofline_time(flops={f:.3g}, bytes={b:.3g}, peak={p:.3g}, bw={bw:.3g}, overhead={oh}) "
                             f"returned {got!r}, expected {exp:.6g}" + (f"\n   hint: {hint}" if hint else ""))
    print(f"✔ check_roofline_time: step times match on {len(cases)} cases")


def _requests(rng: random.Random, n: int) -> list[RequestTimes]:
    reqs = []
    for _ in range(n):
        a = rng.uniform(0, 5)
        first = a + rng.uniform(0.01, 1.0)
        k = rng.choice([1, 2, 5, 20])  # single-token requests have no TPOT
        times = [first + i * rng.uniform(0.005, 0.08) for i in range(k)]
        reqs.append(RequestTimes(a, sorted(times)))
    return reqs


def check_goodput(fn: Callable[..., float], seed: int | None = None) -> None:
    """`fn(ttfts_s, tpots_s, duration_s, slo_ttft_ms, slo_tpot_ms) -> requests/s meeting both SLOs`
    (a NaN TPOT, from a one-token request, cannot miss the TPOT SLO)."""
    rng = random.Random(seed)
    from lab_utils.bench.metrics import tpot, ttft
    for trial in range(25):
        reqs = _requests(rng, rng.randint(1, 30))
        slo_t, slo_p = rng.choice([100, 300, 600]), rng.choice([20, 40, 60])
        dur = rng.uniform(5, 20)
        exp = summarize(reqs, dur, slo_t, slo_p)["request_goodput"]
        ttfts, tpots = [ttft(r) for r in reqs], [tpot(r) for r in reqs]
        got = fn(list(ttfts), list(tpots), dur, slo_t, slo_p)
        if isinstance(got, (int, float)) and not isinstance(got, bool) and math.isclose(got, exp, rel_tol=1e-9, abs_tol=1e-12):
            continue
        hint = ""
        if isinstance(got, (int, float)) and not isinstance(got, bool):
            good_s = sum(t <= slo_t and (math.isnan(p) or p <= slo_p) for t, p in zip(ttfts, tpots))
            either = sum((t * 1e3 <= slo_t) or (not math.isnan(p) and p * 1e3 <= slo_p) for t, p in zip(ttfts, tpots))
            nan_fail = sum(t * 1e3 <= slo_t and not math.isnan(p) and p * 1e3 <= slo_p for t, p in zip(ttfts, tpots))
            if math.isclose(got, exp * dur, rel_tol=1e-9):
                hint = "goodput is a rate: divide the number of good requests by the duration"
            elif math.isclose(got, exp * dur / len(reqs), rel_tol=1e-9):
                hint = "that is the attainment (a share); goodput is good requests per second"
            elif math.isclose(got, good_s / dur, rel_tol=1e-9) and good_s * 1.0 != exp * dur:
                hint = "the times are in seconds and the SLOs in milliseconds: convert before comparing"
            elif math.isclose(got, either / dur, rel_tol=1e-9):
                hint = "a good request meets *both* SLOs (and), not either one"
            elif math.isclose(got, nan_fail / dur, rel_tol=1e-9):
                hint = "a one-token request has TPOT = NaN; it cannot miss the TPOT SLO, so it counts if its TTFT is met"
        raise AssertionError(f"trial {trial}: goodput over {len(reqs)} requests (slo_ttft_ms={slo_t}, slo_tpot_ms={slo_p}, "
                             f"duration {dur:.3f} s) returned {got!r}, expected {exp:.6g}" + (f"\n   hint: {hint}" if hint else ""))
    print("✔ check_goodput: goodput matches bench.metrics on 25 random workloads")


# --- the lab's closing claims --------------------------------------------------------------------------------


def claims(r: dict) -> list[tuple[str, bool]]:
    """Lab 10's claims from the run's measurements `r` (built in the notebook's claims cell).

    The first three are measurements (two real processes, the bytes that crossed the pipe, the simulator against
    the real engine); the goodput and throughput figures come from the simulator at datasheet A100 numbers and are
    labelled checks of the model."""
    from lab_utils.checks.claims import need

    need(r, "same_tokens", "n_prompts", "kv_ratio", "kv_bytes_per_token", "cal_err_ttft", "cal_err_tpot",
         "cal_bound", "goodput", "best_pd", "thr_pd_best", "thr_colo")
    gp, best = r["goodput"], r["best_pd"]
    nochunk, chunk = gp["colocated (no chunking)"], gp["colocated (chunked prefill)"]
    gain_nochunk, gain_chunk = gp[best] / max(nochunk, 1e-9), gp[best] / max(chunk, 1e-9)
    worst_cal = max(r["cal_err_ttft"], r["cal_err_tpot"])
    return [
        (f"measured: a real prefill/decode split over 2 processes gives the same tokens as one engine "
         f"({r['n_prompts']} prompts)", bool(r["same_tokens"])),
        (f"measured: the KV bytes that crossed the pipe = prompt tokens x {r['kv_bytes_per_token']:,} B (+ headers; "
         f"ratio {r['kv_ratio']:.3f}, allowed 0.99-1.2)", 0.99 <= r["kv_ratio"] < 1.2),
        (f"measured: the simulator replays this engine on a held-out workload within {r['cal_bound']:.0%} (TTFT "
         f"error {r['cal_err_ttft']:.1%}, TPOT {r['cal_err_tpot']:.1%}): its scheduling and overheads, not an "
         "A100's roofline", worst_cal <= r["cal_bound"]),
        (f"check of the model (simulated A100s): {best} serves {gain_nochunk:.2f}x the goodput per GPU of "
         f"colocated serving without chunked prefill (DistServe's shape)", gp[best] > nochunk),
        (f"check of the model (simulated A100s): no throughput gain at saturation, best 4-GPU split "
         f"{r['thr_pd_best'] / r['thr_colo']:.2f}x colocated (vLLM's caveat 1)", r["thr_pd_best"] <= r["thr_colo"] * 1.02),
        (f"check of the model (simulated A100s): against chunked prefill the gain shrinks to {gain_chunk:.2f}x "
         f"(from {gain_nochunk:.2f}x; vLLM's caveat 2)", gain_chunk < gain_nochunk),
    ]


def assert_claims(r: dict, show: bool = True) -> None:
    """Print lab 10's claims; AssertionError naming each one that fails."""
    from lab_utils.checks.claims import report

    report(claims(r), show)
