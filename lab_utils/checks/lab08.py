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
from lab_utils.checks.claims import Claim


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
            if len(why) == 1:
                hint = f" Likely cause: {why[0]}."
            elif why:  # this run cannot tell them apart: say so rather than pick one
                hint = " Likely cause, one of (they give the same number on this run): " + "; ".join(why) + "."
            else:
                hint = (f" Your value is {float(got) * dur:.3g} good requests over duration_s, the SLOs give "
                        f"{want * dur:.0f}: a request is good when it has tokens, its TTFT <= slo_ttft_ms and its TPOT "
                        f"<= slo_tpot_ms (an SLO of None is not checked; both in milliseconds).")
            raise AssertionError(
                f"run {k}: {len(reqs)} requests over duration_s={dur}, slo_ttft_ms={ttft_ms}, slo_tpot_ms={tpot_ms}: "
                f"expected goodput {want:.4f} req/s, got {float(got):.4f}.{hint}")
    print(f"check_goodput passed: {runs} random runs (SLO edges, one-token and empty requests, missing SLOs)")


# --- the knob sweep against an SLO ------------------------------------------------------------------------


class _FakeRun:
    """What `run_at` returns in the check: the requests' times and the run's duration, and a throughput that
    does not follow goodput (a sweep that picks by throughput shows)."""

    def __init__(self, requests, duration: float) -> None:
        self.requests, self.duration = requests, duration


def check_sweep(fn: Callable, seed: int | None = 0, trials: int = 20) -> None:
    """`fn(run_at, values, slo_ttft_ms, slo_tpot_ms) -> (best, table)`: runs the engine once per value
    (`run_at(value)` -> a run with `.requests` and `.duration`), `table[value]` = goodput under the SLO, `best` =
    the value with the highest goodput, the smallest such value on a tie (it holds the least KV memory)."""
    rng = random.Random(seed)
    for trial in range(trials):
        values = sorted(rng.sample([1, 2, 4, 8, 16, 32], rng.randint(2, 5)))
        ttft, tpot = rng.choice([150.0, 250.0, 400.0]), rng.choice([40.0, 62.5, 100.0])
        runs = {v: _FakeRun(random_run(rng, rng.randint(4, 14), ttft, tpot), rng.uniform(1.0, 4.0)) for v in values}
        if trial % 4 == 1:  # a tie on goodput between two values
            a, b = values[0], values[-1]
            runs[b] = _FakeRun(list(runs[a].requests), runs[a].duration)
        calls: list = []

        def run_at(v, _runs=runs, _calls=calls):
            _calls.append(v)
            if v not in _runs:
                raise AssertionError(f"run_at({v!r}): sweep only the values given ({sorted(_runs)})")
            return _runs[v]

        got = fn(run_at, list(values), ttft, tpot)
        want_table = {v: reference_goodput(r.requests, r.duration, ttft, tpot) for v, r in runs.items()}
        top = max(want_table.values())
        want_best = min(v for v in values if math.isclose(want_table[v], top, rel_tol=1e-12))
        where = f"trial {trial}: values {values}, SLO TTFT <= {ttft:g} ms, TPOT <= {tpot:g} ms"
        if sorted(calls) != sorted(values):
            raise AssertionError(f"{where}: run_at was called for {calls}; run the engine once per value (each run "
                                 f"costs a whole workload)")
        if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], dict)):
            raise AssertionError(f"{where}: return (best, table), table a dict value -> goodput; got {got!r:.80}")
        best, table = got
        for v in values:
            if v not in table or not math.isclose(table[v], want_table[v], rel_tol=1e-9, abs_tol=1e-12):
                thr = sum(len(r.token_times) for r in runs[v].requests) / runs[v].duration
                hint = ("that is output tokens per second: the table holds goodput (requests per second within "
                        "both SLOs, your goodput function)" if v in table and math.isclose(table[v], thr) else
                        "table[value] = goodput(run.requests, run.duration, slo_ttft_ms, slo_tpot_ms)")
                raise AssertionError(f"{where}: table[{v}] = {table.get(v)!r}, expected {want_table[v]:.4g}"
                                     f"\n   hint: {hint}")
        if best != want_best:
            tie = [v for v in values if math.isclose(want_table[v], top, rel_tol=1e-12)]
            hint = (f"{tie} tie on goodput: take the smallest (the same goodput for less KV memory)" if len(tie) > 1
                    else "the best value has the highest goodput, not the highest throughput or the largest batch")
            raise AssertionError(f"{where}: you chose {best!r}, expected {want_best}\n   hint: {hint}")
    print(f"✔ check_sweep: one engine run per value, goodput table and choice right on {trials} random sweeps "
          f"(ties included)")


# --- the lab's closing claims --------------------------------------------------------------------------------


def claims(r: dict) -> list[Claim]:
    """Lab 08's claims from the run's measurements `r` (built in the notebook's claims cell).

    `rows`: the sweep's rows (engine, config, workload, round and metrics); the configurations a timing claim
    compares ran in alternating rounds (`round` 0, 1, ...; a row without one is round 0), so each claim judges one
    ratio a round (`lab_utils.checks.timing.judge`: NOT JUDGED when the rounds straddle the bar and disagree);
    `goodput`: {(engine, config): req/s in each round (or one number: one round)} under the SLO set from that round's
    one-at-a-time serving; `sweep`: the learner's max_num_seqs sweep of the lab engine, once a round on that round's
    runs and SLO: [{"best": value, "table": {value: goodput}}, ...] (one dict: one round), judged like the timing
    claims on the per-round ratio of the chosen value's goodput to one-at-a-time's; `auto_bytes`: bytes per KV value
    of kv_cache_dtype="auto" (the model's dtype: 4 on a CPU in fp32, 2 on a GPU in bf16), from which the expected
    bf16/fp8 block ratios follow. `step_logs`: the lab engine's step logs of the long-prompt runs; the worst-gap
    claim is judged where this device's step costs, fitted on them, predict that a step of the base config's
    largest size costs >= 1.3x one of the small budget (on a launch-bound GPU they cost about the same: NOT
    JUDGED, saying so). vLLM runs on the same device: its claim reads the same costs."""
    import math

    from lab_utils.checks.claims import need
    from lab_utils.checks.timing import StepCosts, device_condition, judge, ratios

    need(r, "rows", "engines", "goodput", "small_budget", "max_num_seqs", "auto_bytes", "agree", "sweep", "step_logs")
    rows = r["rows"]
    sweeps = r["sweep"] if isinstance(r["sweep"], list) else [r["sweep"]]  # the learner's sweep, one a round
    rerun = "rerun the sweep cell with ROUNDS raised when the machine is quieter"

    def row(engine, config, workload="main", rnd=0):
        return next((x for x in rows if (x["engine"], x["config"], x["workload"], x.get("round", 0))
                     == (engine, config, workload, rnd)), None)

    def by_round(engine, metric, num, den, workload="main") -> list[float]:
        """num/den of `metric` in each round where both configurations ran."""
        pairs = [(row(engine, num, workload, k), row(engine, den, workload, k))
                 for k in sorted({x.get("round", 0) for x in rows})]
        pairs = [(a[metric], b[metric]) for a, b in pairs if a is not None and b is not None]
        return ratios([a for a, _ in pairs], [b for _, b in pairs])

    def rounds_of(x) -> list[float]:
        return [float(v) for v in x] if isinstance(x, (list, tuple)) else [float(x)]

    budget = r["small_budget"]
    costs = StepCosts.fit(r["step_logs"])
    base_step = max((x["max_step_tokens"] for x in rows if (x["engine"], x["config"], x["workload"])
                     == ("lab", "base", "long")), default=budget)
    gap_predicted = costs.cost(base_step) / costs.cost(budget)
    values = sorted({v for s in sweeps for v in s["table"]})
    chosen = [s["table"].get(s["best"], 0.0) for s in sweeps]
    single = [s["table"].get(1, 0.0) for s in sweeps]
    text = (f"measured: your sweep ran the lab engine at max_num_seqs {values} in {len(sweeps)} interleaved round(s); "
            f"under the SLO set by that round's one-at-a-time serving it chose {[s['best'] for s in sweeps]}, which "
            f"serves more requests per second than 1 (" + ", ".join(f"{a:.2f} vs {b:.2f}" for a, b in zip(chosen, single))
            + "): batching pays")
    if all(1 in s["table"] for s in sweeps):
        out = [judge(text, ratios(chosen, single), 1.0, rerun, strict=True)]
    else:
        out = [(text + " -- the sweep never ran max_num_seqs=1: nothing to compare with", False)]
    for e in r["engines"]:
        errors = sum(x["errors"] for x in rows if x["engine"] == e)
        tight, base = row(e, "tight KV"), row(e, "base")
        hit = (row(e, "base", "prefix") or {}).get("prefix_hit_rate", 0.0)
        gp_base, gp_one = rounds_of(r["goodput"][(e, "base")]), rounds_of(r["goodput"][(e, "max_num_seqs=1")])
        prefix = judge(f"{e}: prefix caching cuts median TTFT >= 1.3x (hit rate {hit:.0%})",
                       by_round(e, "median_ttft_ms", "no prefix caching", "base", "prefix"), 1.3, rerun)
        out += [
            (f"{e}: every request of every run completed ({errors} errors)", errors == 0),
            judge(f"{e}: max_num_seqs={r['max_num_seqs']} gives >= 1.5x the throughput of 1",
                  by_round(e, "out_tok_per_s", "base", "max_num_seqs=1"), 1.5, rerun),
            judge(f"{e}: the roomy KV pool gives >= 1.2x the throughput of the tight one",
                  by_round(e, "out_tok_per_s", "base", "tight KV"), 1.2, rerun),
            (f"{e}: the tight budget holds fewer KV blocks ({tight and tight['kv_blocks']} vs {base and base['kv_blocks']})",
             tight is not None and base is not None and tight["kv_blocks"] < base["kv_blocks"]),
            prefix if hit > 0 else (prefix[0] + " -- the cache never hit", False),
            device_condition(
                judge(f"{e}: max_num_batched_tokens={budget} cuts the worst inter-token gap >= 1.3x",
                      by_round(e, "max_itl_ms", "base", f"max_num_batched_tokens={budget}", "long"), 1.3, rerun),
                gap_predicted, 1.3, costs, f"a step of {base_step} tokens (the base config's largest) to cost "
                f"well over one of {budget}: chunking shortens the stall only where a step's cost grows with its "
                "tokens"),
            judge(f"{e}: goodput under SLOs set from one-at-a-time serving rises with concurrency ("
                  + ", ".join(f"{a:.2f} vs {b:.2f}" for a, b in zip(gp_base, gp_one)) + " req/s)",
                  ratios(gp_base, gp_one), 1.0, rerun, strict=True),
        ]
    small = [x for x in rows if (x["engine"], x["config"], x["workload"]) == ("lab", f"max_num_batched_tokens={budget}", "long")]
    base_long = row("lab", "base", "long")
    largest = max((x["max_step_tokens"] for x in small), default=None)
    out.append((f"lab: no step exceeds the token budget of {budget} (largest {largest}), "
                f"while the base config's steps do ({base_long and base_long['max_step_tokens']})",
                largest is not None and base_long is not None and largest <= budget < base_long["max_step_tokens"]))

    def blocks(engine, num, den):
        a, b = row(engine, num), row(engine, den)
        return a["kv_blocks"] / b["kv_blocks"] if a is not None and b is not None and b["kv_blocks"] else float("nan")

    want_bf16 = r["auto_bytes"] / 2
    b16 = blocks("lab", "tight KV, bf16", "tight KV")
    out.append((f"lab: a bf16 KV cache holds {b16:.2f}x the blocks of 'auto' ({r['auto_bytes']}-byte values) at one "
                f"budget (expected {want_bf16:g}x)", b16 >= 0.95 * want_bf16))
    for e in r["engines"]:
        f8 = blocks(e, "tight KV, fp8", "tight KV")
        if not math.isnan(f8):  # NaN: fp8 did not run here (the notebook prints why)
            out.append((f"{e}: an fp8 KV cache holds {f8:.2f}x the blocks of 'auto' at one budget (expected "
                        f"{r['auto_bytes']:g}x)", f8 >= 0.875 * r["auto_bytes"]))
    g = r["agree"]  # a teacher_forced.GreedyRuns, or None where the comparison was not run
    if g is not None:
        out.append((f"lab engine and vLLM: every greedy output is identical or parts first at a near-tie of the "
                    f"model's dtype ({g.describe()})", g.ok))
    return out


def assert_claims(r: dict, show: bool = True) -> None:
    """Print lab 08's claims; AssertionError naming each one that fails."""
    from lab_utils.checks.claims import report

    report(claims(r), show)


# every check_* above also records its result in the learner's own log (lab_utils.workshop.records)
from lab_utils.workshop.records import record_checks  # noqa: E402

record_checks(globals())
