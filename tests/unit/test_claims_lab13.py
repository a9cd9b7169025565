"""Lab 13's claims: a good run passes, and each claim fails when its measurement is perturbed (negative
controls)."""
from __future__ import annotations

import copy

import pytest

pytest.importorskip("xgrammar")

from lab_utils.checks import lab13  # noqa: E402


def good() -> dict:
    return dict(num_tasks=60, prompt_valid_rate=0.1, constrained_valid_rate=1.0, yours_same_as_reference=True,
                neighbours_identical=True, overlap_fill_ms=0.6, overlap_wait_ms=0.02, mask_exposed_ms=2.5,
                step_ms=90.0, mixed_over_free_throughput=[0.9, 0.85, 0.95], vllm_constrained_valid_rate=1.0)


def test_a_good_run_passes(capsys):
    lab13.assert_claims(good())
    assert "FAIL" not in capsys.readouterr().out
    r = good()
    r["vllm_constrained_valid_rate"] = None  # vLLM absent: its claim is left out, the rest still hold
    assert len(lab13.claims(r)) == len(lab13.claims(good())) - 1


@pytest.mark.parametrize("key,value,match", [
    ("constrained_valid_rate", 0.98, "schema-valid"),
    ("prompt_valid_rate", 1.0, "prompt alone"),
    ("yours_same_as_reference", False, "your mask step"),
    ("neighbours_identical", False, "token-identical"),
    ("overlap_wait_ms", 0.6, "waited"),
    ("mask_exposed_ms", 30.0, "critical path"),
    ("mixed_over_free_throughput", [0.3, 0.35, 0.28], "half its requests"),
    ("vllm_constrained_valid_rate", 0.9, "vLLM"),
])
def test_each_claim_can_fail(key, value, match):
    r = copy.deepcopy(good())
    r[key] = value
    with pytest.raises(AssertionError, match=match):
        lab13.assert_claims(r, show=False)


def test_missing_measurement_is_named():
    r = good()
    del r["step_ms"]
    with pytest.raises(KeyError, match="step_ms"):
        lab13.assert_claims(r)


def test_the_mixed_batch_claim_is_not_judged_when_its_rounds_disagree(capsys):
    r = good()
    r["mixed_over_free_throughput"] = [0.3, 0.9, 0.7]   # a busy machine: rounds straddle the bar, far apart
    lab13.assert_claims(r)                              # raises nothing
    assert "NOT JUDGED  a batch with half its requests" in capsys.readouterr().out


@pytest.mark.parametrize("profile, step_ms, wait_ms, exposed_ms, verdict", [
    ("cpu", 90.0, 0.02, 2.5, True),          # a long synchronous forward hides a 0.6 ms fill
    ("launch", 30.0, 0.02, 0.4, True),       # every step padded to 30 ms: still long enough to hide it
    ("fast device", 0.9, 0.35, 0.5, None),   # a 0.4 ms forward cannot hide a 0.6 ms fill: NOT JUDGED, not FAIL
])
def test_the_overlap_claims_are_judged_only_where_the_forward_outlasts_the_fill(profile, step_ms, wait_ms,
                                                                               exposed_ms, verdict):
    r = dict(good(), step_ms=step_ms, overlap_wait_ms=wait_ms, mask_exposed_ms=exposed_ms)
    overlap = [c for c in lab13.claims(r) if "hid behind the forward" in c[0] or "critical path" in c[0]]
    assert len(overlap) == 2 and all(ok is verdict for _, ok in overlap), overlap
    if verdict is None:
        assert all("shorter than the mask fill" in text for text, _ in overlap)
    lab13.assert_claims(r, show=False)


def test_a_fill_that_does_not_hide_behind_a_long_forward_still_fails():
    r = dict(good(), step_ms=30.0, overlap_wait_ms=0.5, mask_exposed_ms=0.9)  # launch profile, overlap broken
    with pytest.raises(AssertionError, match="waited"):
        lab13.assert_claims(r, show=False)
