"""A pytest plugin for the GPU check's `unit` stage (`-p pytest_rows`, this folder on PYTHONPATH): one JSON line
per test, appended to the file GPU_CHECK_ROWS names the moment the test ends, so a stage killed by its timeout
keeps the rows of the tests that finished (a junit XML is written only when pytest exits)."""
from __future__ import annotations

import json
import os


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("GPU_CHECK_ROWS")
    # one row a test: its call, or its setup where that failed or skipped it (then no call follows)
    if not path or not (report.when == "call" or (report.when == "setup" and not report.passed)):
        return
    row = {"test": report.nodeid.split("::", 1)[-1], "outcome": report.outcome,
           "seconds": round(report.duration, 3)}
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)  # the assertion's own message, else the last line
        row["error"] = (crash.message if crash else str(report.longrepr).strip().splitlines()[-1])[:300]
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
