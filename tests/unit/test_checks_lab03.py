"""Lab 03's checker accepts a correct budget-filling step and rejects each common mistake with a useful message."""
from __future__ import annotations

import pytest

from lab_utils.checks import lab03


def good(decodes, prefills, budget):
    out = [(r, 1) for r in decodes[:budget]]
    budget -= len(out)
    for rid, remaining in prefills:
        if budget <= 0:
            break
        out.append((rid, min(remaining, budget)))
        budget -= out[-1][1]
    return out


def test_accepts_correct(capsys):
    lab03.check_fill_budget(good, seed=0)
    lab03.check_fill_budget(good)
    assert "check_fill_budget passed" in capsys.readouterr().out


def _prefill_first(decodes, prefills, budget):
    return good([], prefills, budget) + good(decodes, [], max(budget - sum(min(n, budget) for _, n in prefills), 0))


def _no_chunking(decodes, prefills, budget):
    out = [(r, 1) for r in decodes[:budget]]
    budget -= len(out)
    for rid, remaining in prefills:
        if remaining > budget:
            break
        out.append((rid, remaining))
        budget -= remaining
    return out


def _skip_ahead(decodes, prefills, budget):
    out = [(r, 1) for r in decodes[:budget]]
    budget -= len(out)
    for rid, remaining in prefills:
        if remaining <= budget:
            out.append((rid, remaining))
            budget -= remaining
    return out


def _ignores_budget(decodes, prefills, budget):
    return [(r, 1) for r in decodes] + list(prefills)


def _zero_entries(decodes, prefills, budget):
    out = good(decodes, prefills, budget)
    done = {r for r, _ in out}
    return out + [(r, 0) for r, _ in prefills if r not in done]


@pytest.mark.parametrize("bad, message", [
    (_prefill_first, "scheduled first"),
    (_no_chunking, "chunked"),
    (_skip_ahead, "first come first served"),
    (_ignores_budget, "more than the budget"),
    (_zero_entries, "n >= 1"),
    (lambda d, p, b: None, "returned None"),
])
def test_rejects_mistakes(bad, message):
    with pytest.raises(AssertionError, match=message):
        lab03.check_fill_budget(bad, seed=1)


def test_not_implemented_propagates():
    def todo(d, p, b):
        raise NotImplementedError("hint")

    with pytest.raises(NotImplementedError):
        lab03.check_fill_budget(todo, seed=0)
