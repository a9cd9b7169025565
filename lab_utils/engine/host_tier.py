"""A host-memory tier under the prefix cache (vLLM's `--kv-offloading-size`, SGLang's hierarchical cache).

Without it, a named block the device pool evicts is gone, and a conversation that comes back after others
pushed its prefix out pays its whole prefill again. With it (`EngineConfig.kv_offload_bytes`), the block's K/V
(every layer; an int8 cache's scales too) is copied to host memory as the device evicts it, kept under the
block's chained-hash name with its token ids (a collision is a miss, as on the device), and copied back into a
free device block when a prompt's prefix walk misses the device but finds the name here.

The tier is exclusive: a copy brought back leaves the tier (the device holds it now, and evicts it here again
if it must), so the device pool and the tier hold different blocks and their capacities add up, and no name
is ever held twice. The price: a block evicted, brought back and evicted again is copied out twice.

The tier is bounded in bytes; which entry it drops to make room is an `EvictionPolicy`'s choice (`POLICIES`:
`LRUPolicy`, and `TwoQueuePolicy`, which keeps the prefixes that have come back before).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

Saved = dict[str, torch.Tensor]  # one block's K/V as `KVCache.copy_out` returns it


class EvictionPolicy:
    """Which entry the host tier drops when it needs room. The tier tells it every entry that comes and goes."""

    def inserted(self, key: Hashable) -> None:
        raise NotImplementedError

    def removed(self, key: Hashable, hit: bool) -> None:
        """`key` left the tier: taken back to the device (`hit`), dropped, or replaced."""
        raise NotImplementedError

    def victim(self) -> Hashable:
        """The entry to drop next (the tier then calls `removed` for it)."""
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used first: the entry offloaded longest ago is dropped first (a hit leaves the tier, so
    insertion order is use order)."""

    def __init__(self) -> None:
        self.order: OrderedDict[Hashable, None] = OrderedDict()  # oldest first

    def inserted(self, key: Hashable) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def removed(self, key: Hashable, hit: bool) -> None:
        self.order.pop(key, None)

    def victim(self) -> Hashable:
        return next(iter(self.order))


class TwoQueuePolicy(EvictionPolicy):
    """2Q: an entry whose name came back to the device before (a prefix that proved it returns: a system prompt,
    a conversation's earlier turns) is protected; entries never reused go first, oldest first, and the
    protected ones only when no other is left (oldest first). A scan of one-off prompts cannot push out
    the prefixes that keep coming back, as it can under LRU."""

    def __init__(self, history: int = 1 << 16) -> None:
        self.probation: OrderedDict[Hashable, None] = OrderedDict()  # never came back, oldest first
        self.protected: OrderedDict[Hashable, None] = OrderedDict()  # came back before, oldest first
        self.returned: OrderedDict[Hashable, None] = OrderedDict()  # names that came back (the newest `history`)
        self.history = history

    def inserted(self, key: Hashable) -> None:
        (self.protected if key in self.returned else self.probation)[key] = None

    def removed(self, key: Hashable, hit: bool) -> None:
        self.probation.pop(key, None)
        self.protected.pop(key, None)
        if hit:
            self.returned[key] = None
            self.returned.move_to_end(key)
            if len(self.returned) > self.history:
                self.returned.popitem(last=False)

    def victim(self) -> Hashable:
        return next(iter(self.probation or self.protected))


# `EngineConfig.kv_offload_policy` -> the host tier's eviction policy
POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy, "2q": TwoQueuePolicy}


@dataclass
class Entry:
    token_ids: tuple[int, ...]  # the block's tokens: a name with other tokens is a collision, never a hit
    saved: Saved
    nbytes: int


class HostTier:
    """Blocks the device pool evicted, by name, within `capacity_bytes` of host memory.

    `copy_out(block_id) -> Saved` and `copy_in(block_id, saved)` move one block's K/V between the device cache and
    host tensors (the engine passes `KVCache.copy_out` / `copy_in` bound to its cache)."""

    def __init__(self, capacity_bytes: int, copy_out: Callable[[int], Saved], copy_in: Callable[[int, Saved], None],
                 policy: EvictionPolicy | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.copy_out, self.copy_in = copy_out, copy_in
        self.policy = policy if policy is not None else LRUPolicy()
        self.entries: dict[Hashable, Entry] = {}
        self.bytes_used = 0
        # counters, in blocks and bytes: out = device -> host, in = host -> device
        self.hits = self.blocks_out = self.bytes_out = self.blocks_in = self.bytes_in = 0
        self.dropped = 0  # entries dropped to make room
        self.peak_bytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: Hashable) -> bool:
        return name in self.entries

    def holds(self, name: Hashable, token_ids: tuple[int, ...]) -> bool:
        """True if the tier has the block named `name` with exactly these tokens."""
        e = self.entries.get(name)
        return e is not None and e.token_ids == token_ids

    def offload(self, block_id: int, name: Hashable, token_ids: tuple[int, ...]) -> None:
        """The device is about to reuse `block_id`, which holds the block `name`: keep a host copy of its K/V,
        dropping entries (the policy's victims) until it fits. A block larger than the whole tier is not kept."""
        self._remove(name)
        saved = self.copy_out(block_id)
        nbytes = sum(t.nbytes for t in saved.values())
        if nbytes > self.capacity_bytes:
            return
        while self.bytes_used + nbytes > self.capacity_bytes:
            victim = self.policy.victim()
            if victim not in self.entries:  # else the loop would drop nothing, forever
                raise RuntimeError(f"the host tier's eviction policy {type(self.policy).__name__} chose {victim!r}, "
                                   f"an entry the tier does not hold: an entry leaves the tier only through "
                                   f"offload, take or a drop, and each tells the policy (removed); a block taken "
                                   f"out of tier.entries directly leaves the policy a stale name")
            self._remove(victim)
            self.dropped += 1
        self.entries[name] = Entry(token_ids, saved, nbytes)
        self.bytes_used += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes_used)
        self.policy.inserted(name)
        self.blocks_out += 1
        self.bytes_out += nbytes

    def take(self, name: Hashable, token_ids: tuple[int, ...]) -> Saved | None:
        """A hit leaves the tier (exclusive): its K/V for `restore`, or None if the tier does not hold it."""
        if not self.holds(name, token_ids):
            return None
        e = self.entries[name]
        self._remove(name, hit=True)
        self.hits += 1
        self.blocks_in += 1
        self.bytes_in += e.nbytes
        return e.saved

    def restore(self, block_id: int, saved: Saved) -> None:
        """Copy a block taken from the tier into device block `block_id`."""
        self.copy_in(block_id, saved)

    def _remove(self, name: Hashable, hit: bool = False) -> None:
        e = self.entries.pop(name, None)
        if e is not None:
            self.bytes_used -= e.nbytes
            self.policy.removed(name, hit)

    def stats(self) -> dict:
        return {"host_tier_hits": self.hits, "host_tier_blocks_out": self.blocks_out,
                "host_tier_bytes_out": self.bytes_out, "host_tier_blocks_in": self.blocks_in,
                "host_tier_bytes_in": self.bytes_in, "host_tier_entries": len(self.entries),
                "host_tier_bytes": self.bytes_used, "host_tier_capacity_bytes": self.capacity_bytes,
                "host_tier_dropped": self.dropped}


# the host-tier stats of an engine without the tier (every engine reports them)
STATS_WHEN_OFF = {k: 0 for k in HostTier(0, None, None).stats()}  # type: ignore[arg-type]
