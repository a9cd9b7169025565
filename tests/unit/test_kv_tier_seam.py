"""The seam under the prefix cache (`lab_utils.engine.kv.tier`): both tier kinds are a `Tier`, report one stats
vocabulary, one walk names a prompt's blocks, and one rule refuses a tier under a learner's prefix-cache parts."""
from __future__ import annotations

import pytest
import torch

from lab_utils.engine.kv.block_manager import BlockManager
from lab_utils.engine.kv.disk_tier import DiskTier
from lab_utils.engine.kv.host_tier import HostTier, LRUPolicy
from lab_utils.engine.kv.prefix_cache import block_hash
from lab_utils.engine.kv.tier import (
    HOST_EXTRA_STATS,
    STATS_WHEN_OFF,
    STORE_EXTRA_STATS,
    TIER_STATS,
    Tier,
    attach_tier,
    prompt_block_names,
    tier_stats,
)
from lab_utils.engine.replaceable import REFERENCE
from lab_utils.kvstore.tier import StoreTier


class _Client:
    """The two calls StoreTier makes of a client outside take/put, answered locally (no store process)."""

    class stats:
        calls, seconds = 3, 0.0

    def has(self, key, token_ids) -> bool:
        return False


class _Learners:
    """Parts that replace the named methods (what `is_learners` reports for a learner's saved parts)."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def is_learners(self, name: str) -> bool:
        return name in self.names


def _host(tmp_path=None) -> HostTier:
    disk = DiskTier(1 << 16, tmp_path) if tmp_path is not None else None
    return HostTier(1 << 16, lambda b: {"k": torch.zeros(2)}, lambda b, s: None, LRUPolicy(), disk=disk)


def test_both_tier_kinds_are_tiers_with_one_stats_vocabulary(tmp_path):
    host, store = _host(tmp_path), StoreTier(_Client(), None, None)
    for tier in (host, store):
        assert isinstance(tier, Tier), f"{type(tier).__name__} lacks a method of the Tier protocol"
    fields = {f"host_tier_{k}" for k in TIER_STATS + HOST_EXTRA_STATS} | {f"disk_tier_{k}" for k in TIER_STATS}
    assert set(host.stats()) == fields
    assert set(store.stats()) == {f"store_tier_{k}" for k in TIER_STATS + STORE_EXTRA_STATS}
    assert store.stats()["store_tier_calls"] == 3
    assert set(STATS_WHEN_OFF) == fields | set(store.stats()) and not any(STATS_WHEN_OFF.values())
    host.close()


def test_tier_stats_refuses_a_word_outside_the_vocabulary():
    counts = dict.fromkeys(TIER_STATS, 0)
    assert tier_stats("x", **counts) == {f"x_tier_{k}": 0 for k in TIER_STATS}
    with pytest.raises(ValueError, match=r"missing \['hits'\]"):
        tier_stats("x", **{k: 0 for k in TIER_STATS if k != "hits"})
    with pytest.raises(ValueError, match=r"unknown \['reads'\]"):
        tier_stats("x", reads=1, **counts)


def test_prompt_block_names_chains_full_blocks_lazily():
    ids = list(range(11))
    got = list(prompt_block_names(block_hash, ids, 4))
    want, parent = [], None
    for i in range(2):  # two full blocks of 4; the 3 tokens left are no block
        parent = block_hash(parent, tuple(ids[4 * i:4 * i + 4]))
        want.append((parent, tuple(ids[4 * i:4 * i + 4])))
    assert got == want
    assert list(prompt_block_names(block_hash, ids, 4, limit=1)) == want[:1]
    calls = []
    walk = prompt_block_names(lambda p, t: calls.append(t) or len(calls), ids, 2)
    next(walk)
    assert len(calls) == 1, "the walk hashes a block only when it is asked for"


@pytest.mark.parametrize("kind", ["host", "store"])
def test_a_tier_is_refused_under_the_learners_prefix_walk_and_closed(kind, tmp_path):
    tier = _host(tmp_path) if kind == "host" else StoreTier(_Client(), None, None)
    bm = BlockManager(8, 4)
    with pytest.raises(ValueError, match=r"learner's block_manager\.evict: turn the setting off"):
        attach_tier(bm, tier, _Learners("block_manager.evict"), "the setting")
    assert bm.host_tier is None
    if kind == "host":
        assert tier.disk.closed, "a refused tier gives back its files"
    attach_tier(bm, tier if kind == "store" else _host(), _Learners("block_manager.recycle"), "the setting")
    assert bm.host_tier is not None


def test_the_store_alone_is_refused_under_a_learners_hash_block():
    parts = _Learners("block_manager.hash_block")
    attach_tier(BlockManager(8, 4), _host(), parts, "host")
    with pytest.raises(ValueError, match="hash_block"):
        attach_tier(BlockManager(8, 4), StoreTier(_Client(), None, None), parts, "store")


def test_one_tier_under_a_block_manager_and_only_with_a_prefix_cache():
    bm = BlockManager(8, 4)
    attach_tier(bm, _host(), REFERENCE, "host")
    with pytest.raises(ValueError, match="has a host tier already"):
        attach_tier(bm, StoreTier(_Client(), None, None), REFERENCE, "the store")
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        attach_tier(BlockManager(8, 4, enable_prefix_caching=False), _host(), REFERENCE, "host")


def test_a_policy_that_lost_track_of_an_entry_breaks_the_books():
    tier = _host()
    tier.offload(0, "a", (1, 2))
    assert tier.books() == ""
    tier.policy.order.pop("a")
    assert "policy tracks 0 names, the tier holds 1" in tier.books()
