"""A wrong promote injected into lab 14 stops the lab at its check, with the named mistake (a copy left in the
host tier), before any measurement runs the engine with it, and it is not saved as the learner's part."""
from __future__ import annotations

import pytest
from inject import assert_fails_at_check

from lab_utils.paths import REPO_ROOT

pytestmark = pytest.mark.notebooks

# reads the tier's copy but leaves the entry there: a stale copy
STALE = """
tier = self.host_tier
if tier is None or not tier.holds(name, ids):
    return None
if not self.free_ids:
    mine = [b for b in hits if b in self.evictable]
    if len(self.evictable) <= len(mine):
        return None
    for b in mine:
        self.evictable.move_to_end(b)
saved = tier.entries[name].saved
block_id = self.take_block()
tier.restore(block_id, saved)
block = self.blocks[block_id]
block.ref_count, block.hash, block.token_ids = 0, name, ids
self.hash_to_block[name] = block_id
self.evictable[block_id] = None
return block_id
"""


def test_a_stale_copy_fails_at_the_check(tmp_path):
    assert_fails_at_check(REPO_ROOT / "labs" / "14_kv_beyond_the_device.ipynb", "def promote(", STALE,
                          "stale copy", "lab14.check_promote(", tmp_path)
