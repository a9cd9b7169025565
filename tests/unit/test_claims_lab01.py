"""Lab 01's claims cell: holds on good runs, is NOT JUDGED (never a false FAIL) when a loaded machine's rounds
disagree, and each claim fails on a perturbed run, loaded or not."""
from __future__ import annotations

import pytest

from lab_utils.checks import lab01
from lab_utils.checks.timing import ratios

CALLS = {name: 40 for name in lab01.CONTINUOUS_RUN_PARTS}


def _run(throughput_rounds: list[float], **change) -> dict:
    return dict(throughput_rounds=throughput_rounds, static_steps=97, continuous_steps=76,
                mismatch={"lab/static": [], "lab/continuous": []}, static_eq_cont=True, calls=dict(CALLS)) | change


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
