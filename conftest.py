"""Repo-wide pytest hooks: mark notebook cells (nbval) as `notebooks` and print a per-lab time table."""
from __future__ import annotations

import collections
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_lab_times: dict[str, float] = collections.defaultdict(float)


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if str(item.fspath).endswith(".ipynb"):
            item.add_marker(pytest.mark.notebooks)


def pytest_runtest_logreport(report):
    if report.when == "call" and ".ipynb" in report.nodeid:
        _lab_times[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    if _lab_times:
        terminalreporter.write_sep("-", "time per lab (nbval, SMOKE)")
        for lab, secs in sorted(_lab_times.items()):
            terminalreporter.write_line(f"{secs:8.1f} s  {lab}")
