"""Lab 06's checker accepts correct KD losses and rejects each common mistake with a message that names it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lab_utils.checks import lab06


def good(s, t, T):  # an independent solution via F.kl_div
    return F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), log_target=True, reduction="batchmean") * T * T


def test_accepts_correct(capsys):
    lab06.check_kd_loss(good, seed=0)
    lab06.check_kd_loss(good)
    assert "✓" in capsys.readouterr().out


@pytest.mark.parametrize("bad, msg", [
    (lambda s, t, T: good(s, t, T) / (T * T), "factor is missing"),
    (lambda s, t, T: F.kl_div(F.log_softmax(t / T, -1), F.log_softmax(s / T, -1), log_target=True,
                              reduction="batchmean") * T * T, "KL is reversed"),
    (lambda s, t, T: good(s, t, 1.0) * T * T, "temperature is not applied"),
    (lambda s, t, T: F.kl_div(F.log_softmax(s, -1), F.log_softmax(t / T, -1), log_target=True,
                              reduction="batchmean") * T * T, "only the teacher"),
    (lambda s, t, T: good(s, t, T) * s.shape[0], "summed over rows"),
    (lambda s, t, T: F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), log_target=True,
                              reduction="none").sum(-1) * T * T, "scalar"),
    (lambda s, t, T: good(s.detach(), t, T), "autograd"),
    (lambda s, t, T: F.mse_loss(s, t), "expected"),
])
def test_rejects_mistakes(bad, msg):
    with pytest.raises(AssertionError, match=msg):
        lab06.check_kd_loss(bad, seed=1)


def test_not_implemented_propagates():
    def todo(s, t, T):
        raise NotImplementedError("hint")

    with pytest.raises(NotImplementedError):
        lab06.check_kd_loss(todo, seed=0)


def _log_of_softmax(s, t, T):  # right in exact arithmetic; -inf/nan once a probability underflows to 0
    p, q = (t / T).softmax(-1), (s / T).softmax(-1)
    return (p * (p.log() - q.log())).sum(-1).mean() * T * T


def _log_of_softmax_clamped_student(s, t, T):  # the teacher's log still underflows: 0 * log(0) = nan
    p, q = (t / T).softmax(-1), (s / T).softmax(-1)
    return (p * (p.log() - q.clamp_min(1e-30).log())).sum(-1).mean() * T * T


@pytest.mark.parametrize("bad", [_log_of_softmax, _log_of_softmax_clamped_student])
def test_rejects_the_log_of_a_softmax_at_a_real_logit_range(bad):
    bad(torch.randn(4, 10) * 3, torch.randn(4, 10) * 3, 0.5)  # right on moderate logits: the large case catches it
    with pytest.raises(AssertionError, match="it looks like the log of a softmax") as err:
        lab06.check_kd_loss(bad, seed=1)
    assert "T=0.5" in str(err.value) and "spanning" in str(err.value)


@pytest.mark.parametrize("bad", [
    lambda s, t, T: good(s, t, T) / (T * T),
    lambda s, t, T: good(s, t, 1.0) * T * T,
])
def test_the_underflow_cause_stays_silent_on_other_mistakes(bad):
    with pytest.raises(AssertionError) as err:
        lab06.check_kd_loss(bad, seed=1)
    assert "log of a softmax" not in str(err.value) and "it looks like" in str(err.value)


@pytest.mark.parametrize("bad", [
    lambda s, t, T: good(s.transpose(0, 1), t.transpose(0, 1), T),   # softmax over the rows
    lambda s, t, T: good(s, t, T) + 0.1,
])
def test_an_unrecognised_wrong_loss_still_states_the_rule(bad):
    with pytest.raises(AssertionError, match="the loss is T\\^2 times the mean over rows"):
        lab06.check_kd_loss(bad, seed=1)
