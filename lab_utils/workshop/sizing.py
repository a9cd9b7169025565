"""Per-learner limits from one setting, the room's size: memory, CPU, torch threads and the engine's KV budget.

    reserve   = max(2 GiB, 10% of RAM)                 the hub, the proxy, the OS page cache
    memory    = (RAM - reserve) / learners             what one learner's server may hold
    cpu       = cores / learners                       a share (time-sliced), at least 0.1
    threads   = max(1, cores // learners)              torch's intra-op threads (OMP_NUM_THREADS)
    kv budget = min(1 GiB, (memory - KERNEL_BASE) / 2) the other half stays for activations and the learner's own
                                                       objects; 1 GiB is the engine's CPU default

KERNEL_BASE is one learner's server before the room's KV budget, measured (`lab_utils.workshop.capacity`, labs
00-04 in SMOKE on the CPU, SmolLM2-135M in float32, one kernel a lab): the kernel's peak resident set was 1.7 GiB
in lab 00, 2.7 in lab 01, 0.7 in 02, 0.9 in 03 and 2.8 GiB in lab 04 (USS, the pages no other process shares,
0.2 GiB less), the same with a 64 MiB KV budget as with the engine's 1 GiB default, so the labs' own engines and
models make the peak; an idle Jupyter server holds 0.12 GiB more: 2.94 GiB, rounded up to 3 GiB. A room whose
share is below KERNEL_BASE + 64 MiB of KV is refused with the largest room that fits.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

GiB, MiB = 1 << 30, 1 << 20
KERNEL_BASE = 3 * GiB  # measured: the peak kernel through labs 00-04 and its Jupyter server
MIN_KV = 64 * MiB
MAX_KV = 1 * GiB


@dataclass(frozen=True)
class Share:
    learners: int
    mem_bytes: int
    cpu: float
    threads: int
    kv_bytes: int

    def env(self) -> dict[str, str]:
        """What a learner's server runs with."""
        return {"OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads),
                "LAB_KV_CACHE_MEMORY_BYTES": str(self.kv_bytes)}

    def __str__(self) -> str:
        return (f"{self.learners} learners: {self.mem_bytes / GiB:.1f} GiB, {self.cpu:g} CPU, {self.threads} "
                f"thread(s), {self.kv_bytes / MiB:.0f} MiB of KV each")


def box() -> tuple[int, int]:
    """(bytes of RAM, CPU cores) of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), os.cpu_count() or 1


def share(learners: int, ram: int | None = None, cores: int | None = None) -> Share:
    """One learner's share of a box for a room of `learners`. ValueError when the room does not fit."""
    if learners < 1:
        raise ValueError(f"learners={learners}: a room has at least 1 learner")
    if ram is None or cores is None:
        r, c = box()
        ram, cores = ram or r, cores or c
    reserve = max(2 * GiB, ram // 10)
    mem = (ram - reserve) // learners
    if mem < KERNEL_BASE + MIN_KV:
        fits = max(0, (ram - reserve) // (KERNEL_BASE + MIN_KV))
        raise ValueError(f"learners={learners}: {mem / GiB:.2f} GiB each on a {ram / GiB:.0f} GiB box, below the "
                         f"{(KERNEL_BASE + MIN_KV) / GiB:.2f} GiB one kernel needs; this box holds at most {fits}")
    kv = max(MIN_KV, min(MAX_KV, (mem - KERNEL_BASE) // 2))
    return Share(learners, int(mem), max(0.1, round(cores / learners, 2)), max(1, cores // learners), int(kv))
