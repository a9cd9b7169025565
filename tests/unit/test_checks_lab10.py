"""Lab 10's checkers accept correct solutions and reject each common mistake with a message that names it."""
from __future__ import annotations

import math

import pytest

from lab_utils.checks import lab10


def good_roof(f, b, p, bw, oh):
    return max(f / p, b / bw) + oh


def test_roofline_checker_accepts_correct(capsys):
    lab10.check_roofline_time(good_roof, seed=0)
    lab10.check_roofline_time(good_roof)
    assert "✔" in capsys.readouterr().out


@pytest.mark.parametrize("bad, msg", [
    (lambda f, b, p, bw, oh: f / p + b / bw + oh, "not their sum"),
    (lambda f, b, p, bw, oh: max(f / p, b / bw), "overhead"),
    (lambda f, b, p, bw, oh: min(f / p, b / bw) + oh, "max, not min"),
])
def test_roofline_checker_rejects_mistakes(bad, msg):
    with pytest.raises(AssertionError, match=msg):
        lab10.check_roofline_time(bad, seed=1)


def good_goodput(ttfts, tpots, dur, slo_t, slo_p):
    ok = sum(t * 1e3 <= slo_t and (math.isnan(p) or p * 1e3 <= slo_p) for t, p in zip(ttfts, tpots))
    return ok / dur


def test_goodput_checker_accepts_correct(capsys):
    lab10.check_goodput(good_goodput, seed=0)
    lab10.check_goodput(good_goodput)
    assert "✔" in capsys.readouterr().out


@pytest.mark.parametrize("bad, msg", [
    (lambda tt, tp, d, a, b: good_goodput(tt, tp, d, a, b) * d, "divide the number of good requests"),
    (lambda tt, tp, d, a, b: good_goodput(tt, tp, d, a, b) * d / len(tt), "attainment"),
    (lambda tt, tp, d, a, b: sum((t * 1e3 <= a) or (not math.isnan(p) and p * 1e3 <= b) for t, p in zip(tt, tp)) / d,
     "both"),
    (lambda tt, tp, d, a, b: sum(t * 1e3 <= a and not math.isnan(p) and p * 1e3 <= b for t, p in zip(tt, tp)) / d,
     "NaN"),
])
def test_goodput_checker_rejects_mistakes(bad, msg):
    with pytest.raises(AssertionError, match=msg):
        lab10.check_goodput(bad, seed=3)


def test_goodput_checker_lets_not_implemented_through():
    def todo(*a):
        raise NotImplementedError("hint")
    with pytest.raises(NotImplementedError):
        lab10.check_goodput(todo)
