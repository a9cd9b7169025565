"""lab_utils.threads: a lab uses the cores idle when it starts (LAB_THREADS decides instead), never fewer than one."""
from __future__ import annotations

import pytest
import torch

from lab_utils import threads


@pytest.fixture
def keep_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("LAB_THREADS", raising=False)
    yield monkeypatch
    torch.set_num_threads(before)


def test_a_busy_cpu_gets_fewer_threads_and_says_why(keep_threads, capsys):
    torch.set_num_threads(2)
    keep_threads.setattr(threads, "idle_cores", lambda window_s=0.25: 0.3)   # both cores held by other programs
    assert threads.fit_threads() == 1 and torch.get_num_threads() == 1
    assert "the CPU is busy (0.3 of" in capsys.readouterr().out


def test_an_idle_cpu_keeps_every_thread_and_prints_nothing(keep_threads, capsys):
    torch.set_num_threads(2)
    keep_threads.setattr(threads, "idle_cores", lambda window_s=0.25: 1.9)
    assert threads.fit_threads() == 2 and torch.get_num_threads() == 2
    assert capsys.readouterr().out == ""


def test_lab_threads_decides(keep_threads):
    torch.set_num_threads(2)
    keep_threads.setenv("LAB_THREADS", "1")
    keep_threads.setattr(threads, "idle_cores", lambda window_s=0.25: pytest.fail("measured although LAB_THREADS is set"))
    assert threads.fit_threads(verbose=False) == 1


def test_idle_cores_reads_this_machine():
    idle = threads.idle_cores(0.05)
    assert idle is None or 0.0 <= idle <= (__import__("os").cpu_count() or 1) + 0.01
