"""Lab 13's checker accepts a correct mask step and rejects plausible wrong ones; its claims fail when a
measurement is perturbed (negative controls)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("xgrammar")

from lab_utils.checks import lab13  # noqa: E402
from lab_utils.structured.hook import advance_matcher, apply_token_bitmask  # noqa: E402


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


def _inverted(logits, bitmask):
    allowed = apply_token_bitmask(logits.clone(), bitmask).isfinite()
    return logits.masked_fill(allowed, float("-inf"))


def _words_as_unsigned_31_bits(logits, bitmask):  # bit 31 (the sign bit) dropped: token 32*w + 31 never allowed
    allowed = apply_token_bitmask(logits.clone(), bitmask & 0x7FFFFFFF).isfinite()
    return logits.masked_fill(~allowed, float("-inf"))


def test_mask_causes_name_the_mistake_and_stay_silent_on_the_other():
    with pytest.raises(AssertionError, match="your mask is inverted") as err:
        lab13.check_mask_step(_inverted, advance_matcher, seed=0)
    assert "least significant" not in str(err.value)
    with pytest.raises(AssertionError, match="least significant|sign bit included") as err:
        lab13.check_mask_step(_words_as_unsigned_31_bits, advance_matcher, seed=0)
    assert "inverted" not in str(err.value)
