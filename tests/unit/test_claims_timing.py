"""lab_utils.checks.timing: interleaved rounds, per-round ratios, and a verdict that can say 'not judged'."""
from __future__ import annotations

import math

import pytest

from lab_utils.checks.claims import report
from lab_utils.checks.timing import interleave, judge, judge_error, ratios, verdict


def test_interleave_alternates_the_sides():
    order = []
    out = interleave({"a": lambda: order.append("a") or 1, "b": lambda: order.append("b") or 2}, 3)
    assert order == ["a", "b"] * 3 and out == {"a": [1, 1, 1], "b": [2, 2, 2]}
    with pytest.raises(ValueError):
        interleave({"a": lambda: 1}, 0)


def test_a_round_with_zero_on_both_sides_is_dropped():
    assert ratios([0.0, 2.0, 1.0], [0.0, 1.0, 0.0]) == [2.0, math.inf]
    with pytest.raises(ValueError):
        ratios([1.0], [1.0, 2.0])


@pytest.mark.parametrize("rounds, bar, strict, want", [
    ([3.1, 2.8, 3.4], 2.0, False, True),      # every round clears it
    ([1.1, 1.3, 1.2], 2.0, False, False),     # no round does
    ([2.1, 1.9, 2.05], 2.0, False, True),     # straddle, rounds agree: the median decides
    ([1.95, 2.05, 1.9], 2.0, False, False),
    ([3.3, 1.2, 2.9], 2.0, False, None),      # straddle, rounds disagree: too busy to tell
    ([], 1.0, True, None),                    # nothing measured (0 vs 0 in every round)
    ([1.0, 1.0], 1.0, True, False),           # equal is not higher
    ([math.inf, 2.0], 1.0, True, True),
])
def test_verdict(rounds, bar, strict, want):
    assert verdict(rounds, bar, strict) is want


def test_a_claim_not_judged_says_why_and_how_to_rerun_and_raises_nothing(capsys):
    claim = judge("A beats B", [3.3, 1.2, 2.9], 2.0, "rerun cell 7")
    assert claim[1] is None and "NOT JUDGED" in claim[0] and "rerun cell 7" in claim[0]
    report([claim, ("a plain claim", True)])
    assert "NOT JUDGED  A beats B" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="1 of 2"):
        report([claim, ("a plain claim", False)], show=False)


@pytest.mark.parametrize("errors, spreads, want", [
    ({"TTFT": 0.10, "TPOT": 0.20}, {"TTFT": 0.90, "TPOT": 0.05}, True),    # within the bound: noise is no excuse
    ({"TTFT": 0.60, "TPOT": 0.20}, {"TTFT": 0.05, "TPOT": 0.05}, False),   # repeats agree, the prediction is off
    ({"TTFT": 0.60, "TPOT": 0.20}, {"TTFT": 0.80, "TPOT": 0.05}, None),    # repeats disagree beyond the bound
    ({"TTFT": 0.60, "TPOT": 0.50}, {"TTFT": 0.80, "TPOT": 0.05}, False),   # one metric fails on steady repeats
])
def test_judge_error_says_not_judged_only_when_the_measurement_is_too_noisy(errors, spreads, want):
    text, ok = judge_error("the model predicts the run", errors, spreads, 0.35, "rerun the calibration cell")
    assert ok is want
    assert ("NOT JUDGED" in text and "rerun the calibration cell" in text and "TTFT 80%" in text) == (want is None)
