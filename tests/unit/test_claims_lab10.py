"""Negative controls for lab 10's claims: a good run passes, each perturbed result fails its claim."""
from __future__ import annotations

import copy

import pytest

from lab_utils.checks import lab10


def good() -> dict:
    gp = {"colocated (no chunking)": 8.0, "colocated (chunked prefill)": 12.0, "1P:1D": 6.0, "2P:1D": 10.0,
          "3P:1D": 12.0}
    return dict(same_tokens=True, n_prompts=6, kv_audit={"requests": 6, "blocks": 18, "mismatched": []},
                top_rate={name: 24.0 for name in gp},
                handoff_ran={"prefill": ["disagg.export_kv", "disagg.request_meta"], "decode": ["disagg.import_kv", "disagg.resume_prefilled"]},
                kv_ratio=1.002, kv_bytes_per_token=46080, cal_err_ttft=0.058,
                cal_err_tpot=0.048, cal_spread_ttft=0.06, cal_spread_tpot=0.03, cal_bound=0.35, goodput=gp, best_pd="3P:1D", thr_pd_best=5635.0, thr_colo=6746.0,
                cal_fit_err=0.08)


def test_a_good_run_passes(capsys):
    lab10.assert_claims(good())
    out = capsys.readouterr().out
    assert "FAIL" not in out and out.count("check of the model") == 3


def with_(key, value, sub=None):
    r = copy.deepcopy(good())
    if sub is None:
        r[key] = value
    else:
        r[key][sub] = value
    return r


@pytest.mark.parametrize("key, sub, value, message", [
    ("same_tokens", None, False, "hands over the KV intact"),      # a decode worker that loses the KV
    ("kv_audit", "mismatched", [("b1-0", 1)], "hands over the KV intact"),  # blocks swapped: same tokens, wrong KV
    ("kv_audit", "requests", 0, "hands over the KV intact"),               # nothing was audited
    ("top_rate", "colocated (chunked prefill)", 12.0, "against chunked prefill"),  # the grid's ceiling, not a figure
    ("top_rate", "3P:1D", 12.0, "DistServe's shape"),
    ("handoff_ran", "decode", ["disagg.import_kv"], "your export_kv"),  # the decode worker ran the reference
    ("handoff_ran", "prefill", [], "your export_kv"),
    ("handoff_ran", "prefill", ["disagg.export_kv"], "your export_kv"),   # the header built by the reference
    ("kv_ratio", None, 2.0, "KV bytes that crossed the pipe"),     # whole blocks sent twice
    ("kv_ratio", None, 0.5, "KV bytes that crossed the pipe"),     # half the layers missing
    ("cal_err_tpot", None, 0.6, "replays this engine"),         # steady repeats, a prediction that is off
    ("goodput", "3P:1D", 7.0, "DistServe's shape"),
    ("thr_pd_best", None, 8000.0, "no throughput gain"),
    ("goodput", "colocated (chunked prefill)", 6.0, "against chunked prefill"),
])
def test_each_claim_fails_on_a_wrong_result(key, sub, value, message):
    with pytest.raises(AssertionError, match=message):
        lab10.assert_claims(with_(key, value, sub), show=False)


def test_the_calibration_is_not_judged_when_the_held_out_runs_disagree(capsys):
    r = with_("cal_err_ttft", 0.6, None)
    r["cal_spread_ttft"] = 0.8  # two repeats' mean TTFT 80% apart: a busy machine, not a bad model
    lab10.assert_claims(r)
    out = capsys.readouterr().out
    assert "NOT JUDGED  measured: the simulator replays" in out and "rerun the calibration cell" in out
    r["cal_err_tpot"] = 0.6  # TPOT off while its repeats agree: a fail all the same
    with pytest.raises(AssertionError, match="replays this engine"):
        lab10.assert_claims(r, show=False)


# ------------------------------------------------------------------------------------------- device profiles
SHAPES = [[(0, 128)], [(0, 64), (70, 1)], [(0, 256)], [(0, 32), (40, 1), (41, 1)]] + [
    [(100 + i, 1)] * k for i in range(3) for k in (1, 2, 4, 8, 16)]


def _fit_error(step_s) -> float:
    """The calibration fit's kind error on steps that cost `step_s(batch)` seconds."""
    from lab_utils.sim.calibrate import StepSample, fit_hardware
    from lab_utils.sim.cost_model import model_spec

    samples = [StepSample(b, len(b), step_s(b)) for b in SHAPES]
    return fit_hardware(model_spec("smollm2-135m"), samples)[1]["step_kind_rel_err"]


def test_the_fit_expresses_compute_bound_and_flat_step_costs_but_not_bimodal_ones():
    """A CPU (cost grows with work) and a launch-bound device (every step ~30 ms) are both within the simulator's
    step model (roofline + per-step overhead); a GPU whose decode steps replay graphs in 5 ms while any prompt
    token costs a 100 ms eager step is not."""
    from lab_utils.sim.cost_model import model_spec, step_cost
    from lab_utils.sim.gpus import cpu_hardware

    spec, cpu = model_spec("smollm2-135m"), cpu_hardware(40e9, 12e9, 0.02, 0.004)
    assert _fit_error(lambda b: step_cost(spec, cpu, b).time_s) < 0.05
    assert _fit_error(lambda b: 0.030 * (1 + 0.01 * (len(b) % 3))) < 0.05
    assert _fit_error(lambda b: 0.100 if any(n > 1 for _, n in b) else 0.005 + 0.0002 * len(b)) > 0.35


def test_a_device_the_simulator_cannot_model_is_not_judged_never_a_false_fail(capsys):
    r = with_("cal_err_ttft", 0.9, None)  # what such a device measures: the replay misses TTFT by far
    r["cal_fit_err"] = 0.7
    text, ok = next(c for c in lab10.claims(r) if "replays this engine" in c[0])
    assert ok is None and "misses this device's own calibration steps by 70%" in text
    lab10.assert_claims(r)  # prints it, raises nothing: the other claims still hold
    assert "NOT JUDGED" in capsys.readouterr().out


def test_a_device_the_simulator_models_is_judged_both_ways():
    assert next(ok for text, ok in lab10.claims(good()) if "replays this engine" in text) is True
    with pytest.raises(AssertionError, match="replays this engine"):
        lab10.assert_claims(with_("cal_err_tpot", 0.6, None), show=False)
