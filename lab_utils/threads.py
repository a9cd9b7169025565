"""How many CPU threads a lab's PyTorch should use on the machine it finds.

PyTorch splits each operation over all cores and waits at its end for the slowest thread. On a laptop where
other programs keep the cores busy (a browser, a video call, an IDE), one of those threads is often waiting for
a core that someone else holds, and every operation waits with it: a decode step of many small operations then
runs several times slower than on one thread. So a lab measures how busy the CPU is when it starts (the idle
share over a quarter of a second, from /proc/stat) and uses only the cores that were idle: at least one.
`LAB_THREADS` sets the number instead.
"""
from __future__ import annotations

import os
import time

import torch


def idle_cores(window_s: float = 0.25) -> float | None:
    """Cores' worth of idle CPU time over `window_s` (e.g. 1.6 of 2), or None where /proc/stat is not readable."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return idle, sum(fields)

    try:
        idle0, total0 = sample()
        time.sleep(window_s)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return (idle1 - idle0) / (total1 - total0) * (os.cpu_count() or 1)


def fit_threads(verbose: bool = True) -> int:
    """Set torch's intra-op threads to the cores idle right now (`LAB_THREADS` overrides); returns the number."""
    wanted = os.environ.get("LAB_THREADS")
    default = torch.get_num_threads()
    if wanted:
        n = max(1, int(wanted))
        why = "LAB_THREADS"
    else:
        idle = idle_cores()
        if idle is None:
            return default
        n = max(1, min(default, int(idle + 0.5)))
        why = f"{idle:.1f} of {os.cpu_count()} cores idle"
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    if verbose and n < default:
        print(f"the CPU is busy ({why}): PyTorch runs {n} thread(s) instead of {default}, so no operation waits "
              f"for a core another program holds (LAB_THREADS={default} to override)")
    return n
