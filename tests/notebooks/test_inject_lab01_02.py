"""A wrong learner implementation injected into labs 01 and 02 stops the lab at the exercise's check, with the
check's named mistake: an AssertionError raised by the check cell, not a traceback from inside the engine and
not a lab that goes on to measure a broken engine."""
from __future__ import annotations

import pytest
from inject import assert_fails_at_check

from lab_utils.paths import REPO_ROOT

pytestmark = pytest.mark.notebooks

LABS = REPO_ROOT / "labs"

# lab 01: finished requests never leave the batch (they keep their slots)
NO_RETIRE = """
out = SchedulerOutput()
budget = self.config.max_num_batched_tokens
while self.waiting and len(self.running) < self.config.max_num_seqs:
    req = self.waiting[0]
    n = req.num_tokens - req.num_computed_tokens
    if n > budget or not self.can_start(req, n):
        break
    n = self.start(req, n)
    out.scheduled.append((req, n))
    budget -= n
if out.scheduled:
    return out
for req in list(self.running):
    if req.status is Status.RUNNING and self.make_room(req, req.num_computed_tokens + 1, out):
        out.scheduled.append((req, 1))
return out
"""

# lab 02: a released block goes back to the pool while another sequence still uses it
RELEASE_IGNORES_COUNT = """
self.blocks[block_id].ref_count = 0
self.recycle(block_id)
"""

# lab 02: the victim is the oldest running request
OLDEST_VICTIM = """
while not self.bm.grow(req, num_tokens):
    victim = self.running[0]
    self.preempt(victim)
    out.preempted.append(victim)
    if victim is req:
        return False
return True
"""


@pytest.mark.parametrize("lab, marker, body, message, check", [
    ("01_continuous_batching", "def schedule_continuous(", NO_RETIRE, "retire finished requests",
     "lab01.check_schedule_continuous("),
    ("02_paged_kv_cache", "def release(", RELEASE_IGNORES_COUNT, "last reference", "lab02.check_allocator("),
    ("02_paged_kv_cache", "def make_room(", OLDEST_VICTIM, "newest running request", "lab02.check_preemption("),
])
def test_wrong_part_fails_at_its_check(lab, marker, body, message, check, tmp_path):
    assert_fails_at_check(LABS / f"{lab}.ipynb", marker, body, message, check, tmp_path)
