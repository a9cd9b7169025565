"""A wrong learner implementation injected into labs 03 and 04 stops the lab at the exercise's check, with the
check's named mistake: an AssertionError raised by the check cell, not a traceback from inside the engine and
not a lab that measures a broken engine."""
from __future__ import annotations

import pytest
from inject import failed_cell, run_with_solution

from lab_utils.paths import REPO_ROOT

pytestmark = pytest.mark.notebooks

LABS = REPO_ROOT / "labs"

# lab 03: new prompts admitted before the running requests get their tokens
ADMIT_FIRST = """
out = SchedulerOutput()
self.running = [r for r in self.running if not r.status.done]
budget = self.config.max_num_batched_tokens
old = list(self.running)
while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
    req = self.waiting[0]
    n = min(req.num_tokens - req.num_computed_tokens, budget)
    if not self.can_start(req, n):
        break
    n = self.start(req, n)
    out.scheduled.append((req, n))
    budget -= n
for req in old:
    n = min(req.num_tokens - req.num_computed_tokens, budget)
    if budget > 0 and req.status is Status.RUNNING and self.make_room(req, req.num_computed_tokens + n, out):
        out.scheduled.append((req, n))
        budget -= n
return out
"""

# lab 04: the whole prompt matched (no token left to compute)
WHOLE_PROMPT = """
found, name, B = [], None, self.block_size
for start in range(0, req.num_prompt_tokens // B * B, B):
    ids = tuple(req.prompt_token_ids[start:start + B])
    name = self.hash_block(name, ids)
    bid = self.hash_to_block.get(name)
    if bid is None or self.blocks[bid].token_ids != ids:
        break
    found.append(bid)
return found
"""

# lab 04: the most recently used block evicted
NEWEST = """
block_id, _ = self.evictable.popitem(last=True)
block = self.blocks[block_id]
del self.hash_to_block[block.hash]
block.hash, block.token_ids = None, ()
return block_id
"""


@pytest.mark.parametrize("lab, marker, body, message, check", [
    ("03_chunked_prefill", "def schedule_token_budget(", ADMIT_FIRST, "running requests come first",
     "lab03.check_schedule_token_budget("),
    ("04_prefix_caching", "def match_prefix(", WHOLE_PROMPT, "leave at least one prompt token",
     "lab04.check_match_prefix("),
    ("04_prefix_caching", "def evict(", NEWEST, "another block than the least recently used", "lab04.check_evict("),
], ids=["03-admit-before-running", "04-match-whole-prompt", "04-evict-newest"])
def test_wrong_part_fails_at_its_check(lab, marker, body, message, check, tmp_path):
    import papermill as pm

    with pytest.raises(pm.PapermillExecutionError) as err:
        run_with_solution(LABS / f"{lab}.ipynb", marker, body, tmp_path)
    assert err.value.ename == "AssertionError", f"{err.value.ename}: {err.value.evalue}"
    assert message in str(err.value), str(err.value)[-2000:]
    cell = failed_cell(tmp_path)
    assert check in cell.source, f"the lab failed in another cell than its check:\n{cell.source}"
    saved = tmp_path / "my_engine" / ("scheduler.py" if lab.startswith("03") else "block_manager.py")
    assert not saved.exists() or marker not in saved.read_text(), "a part that failed its check was saved"
