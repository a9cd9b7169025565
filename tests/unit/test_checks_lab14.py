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
    if tier is None:  # no tier: nothing to promote
        return None
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
    if tier is None:  # no tier: nothing to promote
        return None
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
    if tier is None:  # no tier: nothing to promote
        return None
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
    if tier is None:  # no tier: nothing to promote
        return None
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
    if tier is None:  # no tier: nothing to promote
        return None
    restore = tier.restore
    tier.restore = lambda bid, saved: None
    try:
        return correct(self, name, ids, hits)
    finally:
        tier.restore = restore


def test_the_engines_promote_passes():
    assert lab14.promote_cases(correct) == 300


def promoted_as_oldest(self, name, ids, hits):  # the promoted block first in line for the next eviction
    bid = correct(self, name, ids, hits)
    if bid is not None:
        self.evictable.move_to_end(bid, last=False)
    return bid


def evicts_though_free(self, name, ids, hits):  # makes room even when a free block is left
    tier = getattr(self, "host_tier", None)
    if tier is None or not tier.holds(name, ids):
        return None
    victim = next((b for b in self.evictable if b not in hits), None)
    if self.free_ids and victim is not None:
        free, self.free_ids = list(self.free_ids), type(self.free_ids)()
        try:
            return correct(self, name, ids, hits)
        finally:
            self.free_ids.extend(free)
    return correct(self, name, ids, hits)


CAUSES = {
    collision_is_a_hit: "a collision is a miss",
    evicts_a_hit: "no parent on the device",
    leaves_a_stale_copy: "stale copy",
    policy_not_told: "policy was not told",
    room_before_take: "dropped the very entry",
    left_referenced: "ref_count 0",
    not_copied: "K/V was not copied",
    promoted_as_oldest: "must be the newest cached block",
    evicts_though_free: "a free block was left",
}


@pytest.mark.parametrize("wrong", list(CAUSES), ids=lambda f: f.__name__)
def test_each_mistake_is_named_and_no_other(wrong):
    with pytest.raises(AssertionError) as err:
        lab14.promote_cases(wrong)
    msg = str(err.value)
    assert "block_manager.promote (lab 14, my_engine/block_manager.py)" in msg and CAUSES[wrong] in msg, msg
    others = [c for f, c in CAUSES.items() if f is not wrong and c in msg]
    assert not others, (others, msg)  # each diagnoser stays silent on another mistake


def test_a_reused_hit_is_said_to_be_the_block_returned():
    """The message is true to the printed state: the evicted hit is the block returned, so it looks cached."""
    with pytest.raises(AssertionError) as err:
        lab14.promote_cases(evicts_a_hit)
    msg = str(err.value)
    returned = int(msg.split("afterwards returned is ")[1].split(";")[0])
    assert f"you evicted block {returned}," in msg and "reused it for the promoted block" in msg, msg


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


def evicts_least_recent_other(self, name, ids, hits):  # sound: leaves the hits where they are in the LRU order
    tier = getattr(self, "host_tier", None)
    if tier is None or not tier.holds(name, ids):
        return None
    victim = None
    if not self.free_ids:
        victim = next((b for b in self.evictable if b not in hits), None)
        if victim is None:
            return None
    saved = tier.take(name, ids)
    if victim is None:
        bid = self.take_block()
    else:
        self.evictable.move_to_end(victim, last=False)  # the front: the one evict() takes
        bid = self.take_block()
    tier.restore(bid, saved)
    blk = self.blocks[bid]
    blk.ref_count, blk.hash, blk.token_ids = 0, name, ids
    self.hash_to_block[name] = bid
    self.evictable[bid] = None
    return bid


def crashes_without_a_tier(self, name, ids, hits):  # self.host_tier.holds on None
    if not self.host_tier.holds(name, ids):
        return None
    return correct(self, name, ids, hits)


def evicts_the_newest_other(self, name, ids, hits):  # keeps hits, but evicts the most recently used other block
    tier = getattr(self, "host_tier", None)
    if tier is None or not tier.holds(name, ids):
        return None
    if not self.free_ids:
        others = [b for b in self.evictable if b not in hits]
        if not others:
            return None
        self.evictable.move_to_end(others[-1], last=False)
    saved = tier.take(name, ids)
    bid = self.take_block()
    tier.restore(bid, saved)
    blk = self.blocks[bid]
    blk.ref_count, blk.hash, blk.token_ids = 0, name, ids
    self.hash_to_block[name] = bid
    self.evictable[bid] = None
    return bid


def test_a_sound_version_may_order_the_hits_its_own_way():
    """The contract says: never evict a hit, evict the least recent other block; not where the hits sit."""
    assert lab14.promote_cases(evicts_least_recent_other) == 300


def test_no_tier_is_a_case():
    with pytest.raises(AssertionError) as err:
        lab14.promote_cases(crashes_without_a_tier)
    msg = str(err.value)
    assert "block_manager.promote (lab 14" in msg and "case no tier" in msg and "host_tier is None" in msg, msg


def test_evicting_another_than_the_least_recent_other_is_named():
    with pytest.raises(AssertionError) as err:
        lab14.promote_cases(evicts_the_newest_other)
    msg = str(err.value)
    assert "the least recently used cached block outside hits was block" in msg, msg
    # the block it names as evicted is the one the learner returned (taken for the promoted block)
    returned = int(msg.split("afterwards returned is ")[1].split(";")[0])
    assert f"you evicted block {returned}, but" in msg and "should have stayed cached" in msg, msg
