"""Negative controls for lab 08's claims: a good run passes, each perturbed measurement fails its claim."""
from __future__ import annotations

import copy

import pytest

from lab_utils.checks import lab08
from lab_utils.checks.teacher_forced import GreedyRuns
from tests.unit import step_profiles

BUDGET = 32
# the long workload's steps: the base config prefills a long prompt in one step of 416 tokens beside decodes;
# the small budget cuts it into chunks of 32
LONG_STEPS = [416, 9, 9, 9, 9, 9] + [BUDGET] * 13 + [9] * 20


def step_logs(profile: str) -> list[list[dict]]:
    return [step_profiles.log(LONG_STEPS, profile, decode=[n == 9 for n in LONG_STEPS])]


def _row(engine, config, workload="main", **kw):
    base = dict(engine=engine, config=config, workload=workload, errors=0, out_tok_per_s=20.0, median_ttft_ms=500.0,
                max_itl_ms=300.0, kv_blocks=64, prefix_hit_rate=0.0, max_step_tokens=300)
    return {**base, **kw}


def good(profile: str = "cpu") -> dict:
    rows = []
    for e in ("lab", "vllm"):
        rows += [
            _row(e, "base", out_tok_per_s=40.0, kv_blocks=64),
            _row(e, "base", "prefix", median_ttft_ms=300.0, prefix_hit_rate=0.8),
            _row(e, "base", "long", max_itl_ms=1500.0, max_step_tokens=416),
            _row(e, "max_num_seqs=1", out_tok_per_s=12.0),
            _row(e, "tight KV", out_tok_per_s=25.0, kv_blocks=4),
            _row(e, "tight KV, fp8", kv_blocks=16),
            _row(e, f"max_num_batched_tokens={BUDGET}", "long", max_itl_ms=400.0, max_step_tokens=32),
            _row(e, "no prefix caching", "prefix", median_ttft_ms=900.0),
        ]
    rows.append(_row("lab", "tight KV, bf16", kv_blocks=8))
    goodput = {(e, c): v for e in ("lab", "vllm") for c, v in (("base", 1.2), ("max_num_seqs=1", 0.3))}
    return dict(rows=rows, engines=["lab", "vllm"], goodput=goodput, small_budget=BUDGET, max_num_seqs=8,
                auto_bytes=4, agree=GreedyRuns(total=8, identical=7, near_ties={"3": 2e-4}), sweep={"best": 8, "table": {1: 0.3, 4: 0.9, 8: 1.2}},
                step_logs=step_logs(profile))


def test_a_good_run_passes(capsys):
    lab08.assert_claims(good())
    assert "FAIL" not in capsys.readouterr().out


def test_on_a_gpu_auto_is_bf16_and_the_expected_ratios_follow():
    r = good()
    r["auto_bytes"], r["agree"] = 2, None
    for x in r["rows"]:
        if x["config"] in ("tight KV, bf16",):
            x["kv_blocks"] = 4          # bf16 = auto: the same blocks
        if x["config"] == "tight KV, fp8":
            x["kv_blocks"] = 8          # fp8 = half of bf16's bytes
    lab08.assert_claims(r, show=False)
    r["rows"][-1]["kv_blocks"] = 3      # fewer blocks than auto at the same budget: wrong
    with pytest.raises(AssertionError, match="bf16 KV cache"):
        lab08.assert_claims(r, show=False)


def set_row(r, engine, config, workload, **kw):
    r = copy.deepcopy(r)
    next(x for x in r["rows"] if (x["engine"], x["config"], x["workload"]) == (engine, config, workload)).update(kw)
    return r


@pytest.mark.parametrize("engine, config, workload, change, message", [
    ("lab", "base", "main", dict(errors=2), "every request"),
    ("vllm", "max_num_seqs=1", "main", dict(out_tok_per_s=35.0), "max_num_seqs=8 gives"),     # batching that does nothing
    ("lab", "tight KV", "main", dict(out_tok_per_s=39.0), "roomy KV pool"),
    ("lab", "tight KV", "main", dict(kv_blocks=64), "tight budget holds fewer"),              # a budget that is ignored
    ("vllm", "base", "prefix", dict(prefix_hit_rate=0.0), "prefix caching cuts"),             # a cache that never hits
    ("lab", "no prefix caching", "prefix", dict(median_ttft_ms=320.0), "prefix caching cuts"),
    ("lab", f"max_num_batched_tokens={BUDGET}", "long", dict(max_itl_ms=1400.0), "worst inter-token gap"),
    ("lab", f"max_num_batched_tokens={BUDGET}", "long", dict(max_step_tokens=64), "exceeds the token budget"),
    ("lab", "tight KV, bf16", "main", dict(kv_blocks=4), "bf16 KV cache"),                    # bf16 stored as fp32
    ("vllm", "tight KV, fp8", "main", dict(kv_blocks=8), "fp8 KV cache"),
])
def test_each_claim_fails_on_a_wrong_measurement(engine, config, workload, change, message):
    with pytest.raises(AssertionError, match=message):
        lab08.assert_claims(set_row(good(), engine, config, workload, **change), show=False)


def test_goodput_and_agreement_fail_when_wrong():
    r = good()
    r["goodput"][("lab", "base")] = 0.2  # batched steps too slow for the SLO
    with pytest.raises(AssertionError, match="goodput under SLOs"):
        lab08.assert_claims(r, show=False)
    r = good()
    r["agree"] = GreedyRuns(total=8, identical=6, near_ties={"3": 2e-4}, partings={"5": 1.7})  # a real difference
    with pytest.raises(AssertionError, match="1 parted where the model was sure: 5"):
        lab08.assert_claims(r, show=False)


@pytest.mark.parametrize("sweep", [
    {"best": 1, "table": {1: 0.3, 4: 0.2, 8: 0.1}},     # batching broke the TPOT bar: one at a time wins
    {"best": 8, "table": {4: 0.9, 8: 1.2}},             # the sweep never ran one at a time: nothing to beat
])
def test_the_sweep_claim_fails_when_batching_does_not_pay(sweep):
    r = copy.deepcopy(good())
    r["sweep"] = sweep
    with pytest.raises(AssertionError, match="your sweep ran the lab engine"):
        lab08.assert_claims(r, show=False)


def with_rounds(r, engine, config, workload, metric, values):
    """Copies of the (engine, config, workload) row and of its partner rows for rounds 1.. of an interleaved run;
    the named row's `metric` takes `values` (one a round, round 0 first)."""
    r = copy.deepcopy(r)
    for k in range(1, len(values)):
        r["rows"] += [dict(x, round=k) for x in r["rows"] if x.get("round", 0) == 0 and x["engine"] == engine]
    for x in r["rows"]:
        if (x["engine"], x["config"], x["workload"]) == (engine, config, workload):
            x[metric] = values[x.get("round", 0)]
    return r


@pytest.mark.parametrize("config, workload, metric, values, message", [
    ("max_num_seqs=1", "main", "out_tok_per_s", [12.0, 36.0, 14.0], "max_num_seqs=8 gives"),   # 3.3x, 1.1x, 2.9x
    ("tight KV", "main", "out_tok_per_s", [25.0, 39.0, 20.0], "roomy KV pool"),
    ("no prefix caching", "prefix", "median_ttft_ms", [900.0, 320.0, 800.0], "prefix caching cuts"),
    (f"max_num_batched_tokens={BUDGET}", "long", "max_itl_ms", [400.0, 1400.0, 300.0], "worst inter-token gap"),
])
def test_a_timing_claim_whose_rounds_disagree_is_not_judged_and_does_not_fail(config, workload, metric, values,
                                                                              message, capsys):
    lab08.assert_claims(with_rounds(good(), "lab", config, workload, metric, values))
    line = next(ln for ln in capsys.readouterr().out.splitlines() if message in ln and ln.startswith("NOT JUDGED"))
    assert "median of 3 rounds" in line and "ROUNDS" in line


@pytest.mark.parametrize("config, workload, metric, values, message", [
    ("max_num_seqs=1", "main", "out_tok_per_s", [36.0, 35.0, 38.0], "max_num_seqs=8 gives"),   # no round clears 1.5x
    ("no prefix caching", "prefix", "median_ttft_ms", [320.0, 360.0, 330.0], "prefix caching cuts"),
])
def test_a_timing_claim_no_round_clears_fails(config, workload, metric, values, message):
    with pytest.raises(AssertionError, match=message):
        lab08.assert_claims(with_rounds(good(), "lab", config, workload, metric, values), show=False)


def test_goodput_rounds_judged_by_ratio_and_zero_on_both_sides_says_nothing(capsys):
    r = good()
    r["goodput"][("lab", "base")], r["goodput"][("lab", "max_num_seqs=1")] = [0.0, 1.2, 0.2], [0.0, 0.3, 0.3]
    lab08.assert_claims(r)  # round 0 (0 vs 0) dropped; 4x and 0.67x disagree: not judged, no false FAIL
    assert "NOT JUDGED  lab: goodput under SLOs" in capsys.readouterr().out
    r["goodput"][("lab", "base")] = [0.0, 0.25, 0.2]  # every informative round below one-at-a-time
    with pytest.raises(AssertionError, match="goodput under SLOs"):
        lab08.assert_claims(r, show=False)


def test_the_learners_sweep_is_judged_over_its_rounds(capsys):
    """Your sweep runs once a round (interleaved with the other configurations): rounds that agree decide, rounds
    that straddle the bar and disagree are NOT JUDGED, and no round where batching pays fails."""
    def rounds(*tables):
        return [{"best": max(t, key=lambda n: (t[n], -n)), "table": t} for t in tables]

    r = good()
    r["sweep"] = rounds({1: 0.3, 4: 0.9, 8: 1.2}, {1: 0.4, 4: 1.0, 8: 0.9})
    lab08.assert_claims(r)
    assert "PASS  measured: your sweep ran the lab engine at max_num_seqs [1, 4, 8] in 2 interleaved" in \
        capsys.readouterr().out
    r["sweep"] = rounds({1: 0.3, 4: 0.9, 8: 1.2}, {1: 0.5, 4: 0.2, 8: 0.1})  # 4x, then one at a time wins
    lab08.assert_claims(r)
    assert "NOT JUDGED  measured: your sweep" in capsys.readouterr().out
    r["sweep"] = rounds({1: 0.5, 4: 0.2, 8: 0.1}, {1: 0.6, 4: 0.6, 8: 0.2})  # ties go to the smaller value: 1
    with pytest.raises(AssertionError, match="your sweep ran the lab engine"):
        lab08.assert_claims(r, show=False)


def _gap_claims(r: dict) -> list:
    return [c for c in lab08.claims(r) if "worst inter-token gap" in c[0]]


@pytest.mark.parametrize("profile", ["launch", "gpu"])
def test_on_a_launch_bound_device_the_worst_gap_claim_is_not_judged_never_a_false_fail(profile):
    """Flat step costs: a 416-token step stalls the decodes as long as a 32-token chunk; the gap ratio such a
    device measures (~1x) is NOT JUDGED, saying why; the claims that do not depend on step costs stay judged."""
    r = good(profile)
    for e in ("lab", "vllm"):
        r = set_row(r, e, f"max_num_batched_tokens={BUDGET}", "long", max_itl_ms=1450.0)  # ~1.03x: what it measures
    gaps = _gap_claims(r)
    assert len(gaps) == 2 and all(ok is None and "NOT JUDGED: on this device a step with prompt tokens costs" in text
                                  for text, ok in gaps)
    lab08.assert_claims(r, show=False)  # no FAIL among the others either


def test_on_a_compute_bound_device_the_worst_gap_claim_is_judged_both_ways():
    assert all(ok is True for _, ok in _gap_claims(good("cpu")))
    r = set_row(good("cpu"), "lab", f"max_num_batched_tokens={BUDGET}", "long", max_itl_ms=1450.0)
    assert [ok for _, ok in _gap_claims(r)] == [False, True]
