"""Negative controls for lab 07's claims: a good run passes, each perturbed measurement fails its claim."""
from __future__ import annotations

import copy

import pytest

from lab_utils.checks import lab07


def good() -> dict:
    acc = {"none": None, "ngram k=2": 0.86, "ngram k=4": 0.8, "ngram k=8": 0.69, "draft k=4": 0.07,
           "self-draft k=3": 0.985, "medusa k=4": 0.06, "eagle k=4": 0.07}
    return dict(chi2_good=2.8, chi2_bad=395.0, chi2_crit=20.515, worst_z=1.3, gammas=[1, 2, 4], gaps={},
                n_configs=7, ngram_speedup={2: 1.77, 4: 2.01, 8: 2.17}, verify_cost_ratio=1.5, acceptance=acc,
                speedup={n: 1.0 for n in acc}, smoke=False,
                tokens_per_verify={"none": None, "ngram k=2": 2.6, "ngram k=4": 3.9, "ngram k=8": 5.2, "draft k=4": 1.3,
                                   "self-draft k=3": 3.9, "medusa k=4": 1.06, "eagle k=4": 1.3},
                verify_parts={"spec.residual": True, "spec.accept_reject": True, "spec.verify_greedy": True,
                              "spec.rollback": True}, verify_steps=40, near_tie=1e-3)


def test_a_good_run_passes(capsys):
    lab07.assert_claims(good())
    assert "FAIL" not in capsys.readouterr().out


def test_a_near_tie_is_not_a_failure():
    r = good()
    r["gaps"] = {"ngram k=8": [2e-4]}
    lab07.assert_claims(r, show=False)


def test_the_near_tie_follows_the_dtype():
    """bf16 rounds a logit of 20 by ~0.08: a 0.3 gap is a near-tie there, a real difference in fp32."""
    import torch

    from lab_utils.checks.teacher_forced import rounding_tie

    logit_20 = torch.tensor([20.0, -3.0])
    assert rounding_tie(torch.float32, logit_20) == 1e-3
    bf16 = rounding_tie(torch.bfloat16, logit_20)
    assert 1.0 < bf16 < 1.5
    r = good() | dict(gaps={"draft k=4": [0.3]})
    lab07.assert_claims(r | dict(near_tie=bf16), show=False)
    with pytest.raises(AssertionError, match="token-identical"):
        lab07.assert_claims(r | dict(near_tie=rounding_tie(torch.float32, logit_20)), show=False)
    with pytest.raises(AssertionError, match="token-identical"):  # a corrupted KV gives gaps of several logits
        lab07.assert_claims(good() | dict(gaps={"draft k=4": [4.0]}, near_tie=bf16), show=False)


def test_without_both_drafts_the_comparison_is_left_out():
    r = good()
    del r["acceptance"]["draft k=4"]
    assert not any("self-draft" in text for text, _ in lab07.claims(r))


def with_(key: str, value, sub=None) -> dict:
    r = copy.deepcopy(good())
    if sub is None:
        r[key] = value
    else:
        r[key][sub] = value
    return r


@pytest.mark.parametrize("key, sub, value, message", [
    ("chi2_good", None, 45.0, "keeps p"),                           # a verifier that resamples from p
    ("chi2_bad", None, 5.0, "negative control"),                    # a test too weak to catch it
    ("worst_z", None, 6.0, "check of the verifier"),
    ("gaps", None, {"draft k=4": [0.4]}, "token-identical"),        # a rollback that corrupts the KV
    ("ngram_speedup", None, {2: 0.8, 4: 0.9, 8: 0.7}, "n-gram lookup pays"),
    ("acceptance", "self-draft k=3", 0.05, "self-draft's guesses"),
    ("verify_parts", "spec.rollback", False, "ran your parts"),     # the engine's own rollback ran
    ("verify_steps", None, 0, "ran your parts"),                    # no verify step at all
    ("speedup", "eagle k=4", 5.3, "at most its tokens per verify step"),   # a baseline slowed by a load spike
    ("speedup", "medusa k=4", 1.24, "at most its tokens per verify step"),  # 1.24x at 1.06 tokens per step
])
def test_each_claim_fails_on_a_wrong_measurement(key, sub, value, message):
    with pytest.raises(AssertionError, match=message):
        lab07.assert_claims(with_(key, value, sub), show=False)


def test_in_smoke_the_speedup_ceiling_is_skipped_not_passed(capsys):
    """A one-prompt SMOKE run's speed-ups are noise: the claim says so instead of judging them."""
    r = with_("speedup", 5.3, "eagle k=4") | dict(smoke=True)
    lab07.assert_claims(r)
    line = next(x for x in capsys.readouterr().out.splitlines() if "tokens per verify step" in x)
    assert "skipped in SMOKE: too small to measure" in line and not line.startswith("PASS")
