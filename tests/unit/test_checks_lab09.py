"""Lab 09's checkers accept correct solutions and reject each common mistake with a message that names it."""
from __future__ import annotations

import pytest

from lab_utils.checks import lab09


def good_kv(w, kv, mem, n, u):
    return max(0, int((n * mem * u - w) // kv))


def test_kv_checker_accepts_correct(capsys):
    lab09.check_kv_capacity(good_kv, seed=0)
    lab09.check_kv_capacity(good_kv)
    assert "✔" in capsys.readouterr().out


@pytest.mark.parametrize("bad, msg", [
    (lambda w, kv, mem, n, u: max(0, int((n * (mem * u - w)) // kv)), "weights on every GPU"),
    (lambda w, kv, mem, n, u: max(0, int((mem * u - w) // kv)), "multiply the per-GPU memory"),
    (lambda w, kv, mem, n, u: max(0, int((n * mem - w) // kv)), "gpu_memory_utilization"),
    (lambda w, kv, mem, n, u: int((n * mem * u - w) // kv), "return 0"),
    (lambda w, kv, mem, n, u: str(good_kv(w, kv, mem, n, u)), "return an int"),
])
def test_kv_checker_rejects_mistakes(bad, msg):
    with pytest.raises(AssertionError, match=msg):
        lab09.check_kv_capacity(bad, seed=1)


def test_kv_checker_lets_not_implemented_through():
    def todo(*a):
        raise NotImplementedError("hint")
    with pytest.raises(NotImplementedError):
        lab09.check_kv_capacity(todo)


def good_ar(b, n, bw):
    return 2 * (n - 1) / n * b / bw


def test_allreduce_checker_accepts_correct(capsys):
    lab09.check_allreduce_time(good_ar, seed=0)
    assert "✔" in capsys.readouterr().out


@pytest.mark.parametrize("bad, msg", [
    (lambda b, n, bw: (n - 1) / n * b / bw, "twice"),
    (lambda b, n, bw: 2 * b / bw, r"\(n-1\)/n"),
    (lambda b, n, bw: 2 * (n - 1) * b / bw, "1/n of the data"),
    (lambda b, n, bw: 2 * (n - 1) / n * b / bw + 1e-3, "expected"),
])
def test_allreduce_checker_rejects_mistakes(bad, msg):
    with pytest.raises(AssertionError, match=msg):
        lab09.check_allreduce_time(bad, seed=2)
