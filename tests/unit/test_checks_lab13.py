"""Lab 13's checker accepts a correct mask step and rejects plausible wrong ones; its claims fail when a
measurement is perturbed (negative controls)."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("xgrammar")

from lab_utils.checks import lab13  # noqa: E402
from lab_utils.engine.structured import advance_matcher, apply_token_bitmask  # noqa: E402


def test_check_mask_step_accepts_the_reference(capsys):
    lab13.check_mask_step(apply_token_bitmask, advance_matcher, seed=0)
    lab13.check_mask_step(apply_token_bitmask, advance_matcher)
    assert "passed" in capsys.readouterr().out


def test_check_mask_step_rejects_reversed_bit_order():
    def bad(logits, bitmask):
        shifts = 31 - torch.arange(32, dtype=torch.int32)  # most significant bit first: wrong
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., :logits.shape[-1]].bool()
        return logits.masked_fill(~allowed, float("-inf"))

    with pytest.raises(AssertionError, match="least significant"):
        lab13.check_mask_step(bad, advance_matcher, seed=1)


def test_check_mask_step_rejects_zero_instead_of_minus_inf():
    def bad(logits, bitmask):
        allowed = apply_token_bitmask(logits, bitmask).isfinite()
        return logits * allowed

    with pytest.raises(AssertionError, match="the bitmask says forbidden"):
        lab13.check_mask_step(bad, advance_matcher, seed=2)


def test_check_mask_step_rejects_in_place_without_return():
    def bad(logits, bitmask):
        logits.copy_(apply_token_bitmask(logits, bitmask))

    with pytest.raises(AssertionError, match="returned None"):
        lab13.check_mask_step(bad, advance_matcher, seed=3)


def test_check_mask_step_rejects_advancing_by_the_first_token_only():
    with pytest.raises(AssertionError, match="feed every token"):
        lab13.check_mask_step(apply_token_bitmask, lambda m, toks: m.accept_token(toks[0]) if toks else True)


def test_check_mask_step_rejects_ignoring_refusals():
    def bad(m, toks):
        for t in toks:
            m.accept_token(t)
        return True

    with pytest.raises(AssertionError, match="should return False"):
        lab13.check_mask_step(apply_token_bitmask, bad)


def test_check_mask_step_lets_not_implemented_through():
    def todo(logits, bitmask):
        raise NotImplementedError("write me")

    with pytest.raises(NotImplementedError):
        lab13.check_mask_step(todo, advance_matcher)


# ------------------------------------------------------------------------------------------ claims
def good() -> dict:
    return dict(num_tasks=60, prompt_valid_rate=0.1, constrained_valid_rate=1.0, yours_same_as_reference=True,
                neighbours_identical=True, overlap_fill_ms=0.6, overlap_wait_ms=0.02, mask_exposed_ms=2.5,
                step_ms=90.0, mixed_over_free_throughput=0.9, vllm_constrained_valid_rate=1.0)


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
    ("mixed_over_free_throughput", 0.3, "half its requests"),
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
