"""Negative controls for lab 14's check of the host tier's promote step: the engine's own promote passes, and
each usual mistake is stopped with a message that names the part and the cause."""
from __future__ import annotations

import pytest

from lab_utils.checks import lab14
from lab_utils.engine.kv.block_manager import BlockManager


def correct(self, name, ids, hits):
    return BlockManager.promote(self, name, ids, hits)


def collision_is_a_hit(self, name, ids, hits):  # looks the name up without its tokens
    tier = self.host_tier
    if name not in tier.entries:
        return None
    e = tier.entries[name]
    if not self.free_ids and len(self.evictable) <= len([b for b in hits if b in self.evictable]):
        return None
    for b in [b for b in hits if b in self.evictable]:
        self.evictable.move_to_end(b)
    saved = tier.take(name, e.token_ids)
    bid = self.take_block()
    tier.restore(bid, saved)
    blk = self.blocks[bid]
    blk.ref_count, blk.hash, blk.token_ids = 0, name, ids
    self.hash_to_block[name] = bid
    self.evictable[bid] = None
    return bid


def evicts_a_hit(self, name, ids, hits):  # any cached block may go, the prompt's own earlier ones too
    tier = self.host_tier
    if not tier.holds(name, ids):
        return None
    saved = tier.take(name, ids)
    bid = self.take_block()
    tier.restore(bid, saved)
    blk = self.blocks[bid]
    blk.ref_count, blk.hash, blk.token_ids = 0, name, ids
    self.hash_to_block[name] = bid
    self.evictable[bid] = None
    return bid


def _promote_with(self, name, ids, hits, get):
    tier = self.host_tier
    if not tier.holds(name, ids):
        return None
    in_hits = [b for b in hits if b in self.evictable]
    if not self.free_ids:
        if len(self.evictable) <= len(in_hits):
            return None
        for b in in_hits:
            self.evictable.move_to_end(b)
    saved = get(tier)
    bid = self.take_block()
    tier.restore(bid, saved)
    blk = self.blocks[bid]
    blk.ref_count, blk.hash, blk.token_ids = 0, name, ids
    self.hash_to_block[name] = bid
    self.evictable[bid] = None
    return bid


def leaves_a_stale_copy(self, name, ids, hits):  # reads the entry, leaves it in the tier
    return _promote_with(self, name, ids, hits, lambda tier: tier.entries[name].saved)


def policy_not_told(self, name, ids, hits):  # pops the entry itself: the policy never hears of the hit
    def get(tier):
        e = tier.entries.pop(name)
        tier.bytes_used -= e.nbytes
        tier.hits += 1
        tier.blocks_in += 1
        tier.bytes_in += e.nbytes
        return e.saved
    return _promote_with(self, name, ids, hits, get)


def room_before_take(self, name, ids, hits):  # the eviction's offload can drop the entry being promoted
    tier = self.host_tier
    if not tier.holds(name, ids):
        return None
    in_hits = [b for b in hits if b in self.evictable]
    if not self.free_ids:
        if len(self.evictable) <= len(in_hits):
            return None
        for b in in_hits:
            self.evictable.move_to_end(b)
    bid = self.take_block()
    saved = tier.take(name, ids)
    if saved is None:
        self.blocks[bid].ref_count = 0
        self.free_ids.append(bid)
        return None
    tier.restore(bid, saved)
    blk = self.blocks[bid]
    blk.ref_count, blk.hash, blk.token_ids = 0, name, ids
    self.hash_to_block[name] = bid
    self.evictable[bid] = None
    return bid


def left_referenced(self, name, ids, hits):  # the block keeps take_block's reference: it never comes back
    bid = correct(self, name, ids, hits)
    if bid is not None:
        self.blocks[bid].ref_count = 1
        self.evictable.pop(bid, None)
    return bid


def not_copied(self, name, ids, hits):  # names the block but never copies the K/V back
    tier = self.host_tier
    restore = tier.restore
    tier.restore = lambda bid, saved: None
    try:
        return correct(self, name, ids, hits)
    finally:
        tier.restore = restore


def test_the_engines_promote_passes():
    assert lab14.promote_cases(correct) == 300


@pytest.mark.parametrize("wrong, cause", [
    (collision_is_a_hit, "a collision is a miss"),
    (evicts_a_hit, "no parent on the device"),
    (leaves_a_stale_copy, "stale copy"),
    (policy_not_told, "policy was not told"),
    (room_before_take, "dropped the very entry"),
    (left_referenced, "ref_count 0"),
    (not_copied, "K/V was not copied"),
])
def test_each_mistake_is_named(wrong, cause):
    with pytest.raises(AssertionError) as err:
        lab14.promote_cases(wrong)
    msg = str(err.value)
    assert "block_manager.promote (lab 14" in msg and cause in msg, msg


def test_check_promote_stops_a_wrong_part_before_it_is_saved(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path))
    with pytest.raises(AssertionError, match="stale copy"):
        lab14.check_promote(leaves_a_stale_copy)
    assert not (tmp_path / "block_manager.py").exists()
    from lab_utils.course import learner_parts

    try:
        lab14.check_promote(correct)
        assert "def promote(" in (tmp_path / "block_manager.py").read_text()
    finally:
        learner_parts.forget("block_manager.promote")
