"""The capacity sampler sees a kernel-like child's peak memory and CPU time (what the room's arithmetic rests on)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from lab_utils.workshop import capacity

pytest.importorskip("psutil")

HOLD_64MB = "import sys, time; x = bytearray(64 << 20); x[::4096] = b'1' * len(x[::4096]); time.sleep(1.5)"


def test_the_sampler_records_a_matching_childs_peak_and_ignores_the_rest():
    stop, found = threading.Event(), []
    t = threading.Thread(target=lambda: found.extend(capacity.sample(os.getpid(), "ipykernel", stop, 0.1)))
    t.start()
    try:
        kernel = subprocess.Popen([sys.executable, "-c", HOLD_64MB, "ipykernel"])
        other = subprocess.Popen([sys.executable, "-c", HOLD_64MB, "something-else"])
        kernel.wait(timeout=30)
        other.wait(timeout=30)
    finally:
        stop.set()
        t.join(timeout=10)
    assert len(found) == 1  # only the process whose command line names the match
    peak = found[0]
    assert peak.rss >= 64 << 20 and 0 < peak.uss <= peak.rss and peak.end > peak.start
    assert capacity.HEADER.split()[:2] == ["process", "RSS"] and "kernel 1" in peak.row()
