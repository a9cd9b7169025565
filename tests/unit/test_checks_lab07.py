"""Lab 07's checkers accept correct solutions and reject each common mistake with a message that names it."""
from __future__ import annotations

import pytest
import torch

from lab_utils.checks import lab07


def good_residual(p, q):
    r = torch.clamp(p - q, min=0)
    return p if r.sum() == 0 else r / r.sum()


def good_accept_reject(p, q, draft, u):
    for i, x in enumerate(draft):
        if u[i] >= min(1.0, float(p[i, x] / q[i, x])):
            return i, good_residual(p[i], q[i])
    return len(draft), p[len(draft)]


def test_residual_accepts_a_correct_solution():
    lab07.check_residual(good_residual, seed=0)


@pytest.mark.parametrize("bad, message", [
    (lambda p, q: p, "returned p"),
    (lambda p, q: (p - q) / (p - q).sum(), "negative"),
    (lambda p, q: torch.clamp(p - q, min=0), "normalised"),
    (lambda p, q: torch.clamp(p - q, min=0) / torch.clamp(p - q, min=0).sum(), "fall back to p"),
])
def test_residual_rejects_mistakes(bad, message):
    with pytest.raises(AssertionError, match=message):
        lab07.check_residual(bad, seed=0)


def test_accept_reject_accepts_a_correct_solution():
    lab07.check_accept_reject(good_accept_reject, seed=0)
    lab07.check_accept_reject(lambda p, q, d, u: lab07.reference_accept_reject(p, q, d, u), seed=1)


def _inverted(p, q, draft, u):
    for i, x in enumerate(draft):
        if u[i] < min(1.0, float(p[i, x] / q[i, x])) and u[i] > 0:  # accepts only when u is ABOVE: inverted
            return i, good_residual(p[i], q[i])
    return len(draft), p[len(draft)]


def _resample_from_p(p, q, draft, u):
    n, _ = good_accept_reject(p, q, draft, u)
    return n, p[n]


def _bonus_from_last_draft_row(p, q, draft, u):
    n, d = good_accept_reject(p, q, draft, u)
    return (n, p[n - 1]) if n == len(draft) else (n, d)


def _never_stops(p, q, draft, u):
    kept = sum(1 for i, x in enumerate(draft) if u[i] < min(1.0, float(p[i, x] / q[i, x])))
    return kept, good_residual(p[min(kept, len(draft) - 1)], q[min(kept, len(draft) - 1)]) if kept < len(draft) else p[kept]


@pytest.mark.parametrize("bad, message", [
    (_inverted, "n_accepted"),
    (_resample_from_p, "residual"),
    (_bonus_from_last_draft_row, "bonus"),
    (_never_stops, "n_accepted|dist"),
    (lambda p, q, d, u: (len(d), p[len(d)]), "n_accepted"),
    (lambda p, q, d, u: [0, p[0]], "tuple"),
])
def test_accept_reject_rejects_mistakes(bad, message):
    with pytest.raises(AssertionError, match=message):
        lab07.check_accept_reject(bad, seed=0)


def test_checkers_let_not_implemented_propagate():
    def todo(*a):
        raise NotImplementedError("hint")

    with pytest.raises(NotImplementedError):
        lab07.check_residual(todo, seed=0)
    with pytest.raises(NotImplementedError):
        lab07.check_accept_reject(todo, seed=0)
