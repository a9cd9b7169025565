"""Lab 01's claims cell: holds on good runs, is NOT JUDGED (never a false FAIL) when a loaded machine's rounds
disagree, and each claim fails on a perturbed run, loaded or not."""
from __future__ import annotations

import pytest

from lab_utils.checks import lab01
from lab_utils.checks.timing import ratios
from tests.unit import step_profiles

CALLS = {name: 40 for name in lab01.CONTINUOUS_RUN_PARTS}
# the SMOKE workload's step mix (64 prompts of 16 tokens, 32 slots): static batching prefills two full batches,
# then decodes every slot of its batch until the longest member ends (finished members as padding rows);
# continuous batching admits as slots free up, so its decode steps hold the requests still running
STATIC_STEPS = dict(tokens=[512, 512] + [20] * 95, padding=[0, 0] + [12] * 95)
CONTINUOUS_STEPS = dict(tokens=[512, 200, 120, 80, 60, 52] + [7] * 70)


def step_logs(profile: str) -> dict:
    static, cont = STATIC_STEPS["tokens"], CONTINUOUS_STEPS["tokens"]
    return {"static": step_profiles.log(static, profile, STATIC_STEPS["padding"], decode=[i >= 2 for i in
                                                                                          range(len(static))]),
            "continuous": step_profiles.log(cont, profile, seed=1, decode=[i >= 6 for i in range(len(cont))])}


def _run(throughput_rounds: list[float], profile: str = "cpu", **change) -> dict:
    return dict(throughput_rounds=throughput_rounds, static_steps=97, continuous_steps=76,
                mismatch={"lab/static": [], "lab/continuous": []}, static_eq_cont=True, calls=dict(CALLS),
                step_logs=step_logs(profile)) | change


# continuous / static output tok/s of three interleaved rounds (illustrative numbers of the SMOKE workload's
# order of magnitude): a quiet machine, ...
QUIET = ratios([612.0, 598.0, 620.0], [171.0, 176.0, 169.0])
# ... a loaded one whose load came and went, hitting each round's two runs alike or not
LOADED_AGREE = ratios([301.0, 344.0, 260.0], [92.0, 128.0, 101.0])  # every round >= 2x: passes under load
LOADED_STRADDLE = ratios([310.0, 150.0, 280.0], [95.0, 104.0, 160.0])  # 3.3x, 1.4x, 1.75x: straddles 2x
WRONG = ratios([180.0, 120.0, 205.0], [171.0, 118.0, 190.0])  # continuous no faster (a broken scheduler)


@pytest.mark.parametrize("rounds", [QUIET, LOADED_AGREE], ids=["quiet", "loaded"])
def test_good_runs_pass(rounds, capsys):
    lab01.assert_claims(_run(rounds))
    out = capsys.readouterr().out
    assert "FAIL" not in out and "NOT JUDGED" not in out


def test_rounds_that_disagree_across_the_bar_are_not_judged(capsys):
    claims = lab01.claims(_run(LOADED_STRADDLE))
    assert claims[0][1] is None and "NOT JUDGED" in claims[0][0] and "rerun" in claims[0][0]
    lab01.assert_claims(_run(LOADED_STRADDLE))  # prints it, raises nothing
    assert "NOT JUDGED" in capsys.readouterr().out


def test_one_loaded_round_does_not_fail_a_good_median():
    """Two clear rounds and one where a burst of load hit the continuous run: the rounds straddle 2x but agree
    within the spread allowed, and the median decides."""
    text, ok = lab01.claims(_run([2.6, 2.4, 1.9]))[0]
    assert ok is True, text


@pytest.mark.parametrize("rounds", [WRONG, WRONG[:1], [1.2, 1.5, 1.9]], ids=["loaded", "one round", "all below"])
def test_no_speed_up_fails_even_under_load(rounds):
    with pytest.raises(AssertionError, match=">= 2x the output throughput"):
        lab01.assert_claims(_run(rounds), show=False)


@pytest.mark.parametrize("change, words", [
    ({"continuous_steps": 97}, "fewer engine steps"),
    ({"continuous_steps": 0}, "fewer engine steps"),
    ({"mismatch": {"lab/continuous": ["3"]}}, "identical to one-at-a-time"),
    ({"static_eq_cont": False}, "same tokens"),
    ({"calls": {**CALLS, "engine.stop_reason": 0}}, "never called: engine.stop_reason"),
    ({"calls": {}}, "never called: scheduler.schedule_continuous"),
])
def test_each_claim_can_fail(change, words):
    with pytest.raises(AssertionError, match=words):
        lab01.assert_claims(_run(QUIET, **change), show=False)


def test_missing_measurements_name_the_cells_to_run():
    with pytest.raises(KeyError, match="run the cells above"):
        lab01.claims({"throughput_rounds": QUIET})


def _measured(profile: str) -> list[float]:
    """The throughput ratio each profile's step logs give (same output tokens: static seconds / continuous)."""
    logs = step_logs(profile)
    return [step_profiles.seconds(logs["static"]) / step_profiles.seconds(logs["continuous"])]


@pytest.mark.parametrize("profile", ["launch", "gpu"])
def test_on_a_launch_bound_device_the_2x_claim_is_not_judged_never_a_false_fail(profile):
    """Flat step costs (or the H200's: graph decode steps, eager prompt steps): continuous gains only its fewer
    steps, so >= 2x cannot show; it says why."""
    rounds = _measured(profile)
    assert rounds[0] < 2  # what such a device measures: judged at 2x it would be a false FAIL
    claims = lab01.claims(_run(rounds, profile=profile))
    text, ok = claims[0]
    assert ok is None and "NOT JUDGED: on this device a step with prompt tokens costs" in text and "predicts only" in text
    assert all(ok for _, ok in claims[1:])  # every other claim is judged, and holds
    lab01.assert_claims(_run(rounds, profile=profile), show=False)


def test_on_a_compute_bound_device_the_2x_claim_is_judged_both_ways():
    rounds = _measured("cpu")
    assert lab01.claims(_run(rounds))[0][1] is True
    with pytest.raises(AssertionError, match=">= 2x the output throughput"):  # same step costs, slow runs
        lab01.assert_claims(_run(WRONG), show=False)


def test_step_logs_of_one_size_cannot_be_fitted():
    one = step_profiles.log([7] * 5, "cpu")
    with pytest.raises(ValueError, match="at least two sizes"):
        lab01.claims(_run(QUIET, step_logs={"static": one, "continuous": one}))
