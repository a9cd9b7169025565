"""Lab 01's claims cell: holds on good measurements, and each claim fails on a perturbed one."""
from __future__ import annotations

import pytest

from lab_utils.checks import lab01

GOOD = {"continuous_over_static_throughput": 3.1, "static_over_continuous_engine_steps": 1.6,
        "greedy_identical_to_solo": True, "continuous_ran_your_scheduler": True}


def test_good_measurements_pass():
    lab01.assert_claims(dict(GOOD), {"lab/static": []}, True)


@pytest.mark.parametrize("change, words", [
    ({"continuous_over_static_throughput": 1.4}, "only 1.40x"),
    ({"static_over_continuous_engine_steps": 0.9}, "engine steps"),
    ({"greedy_identical_to_solo": False}, "differs from one-at-a-time"),
    ({"continuous_ran_your_scheduler": False}, "did not use your scheduling step"),
])
def test_each_claim_can_fail(change, words):
    with pytest.raises(AssertionError, match=words):
        lab01.assert_claims({**GOOD, **change}, {}, True)
    with pytest.raises(AssertionError, match="different tokens"):
        lab01.assert_claims(dict(GOOD), {}, False)
