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

Below it, optionally, a disk tier (`disk_tier.DiskTier`, `EngineConfig.kv_offload_disk_bytes`): an entry the
host tier drops goes to disk instead of vanishing. A lookup that misses the device and the host but hits the
disk reads the block straight into its device block (one copy, no detour through the host tier's bytes). And
`prefetch`, called when a request is added, reads the disk blocks of its prompt into the host tier on a
background thread, so that by the time the request is admitted they are host hits: the reads overlap the steps
of the requests running meanwhile. An entry being prefetched is held (`pending`) with its bytes counted; a
lookup that reaches it before the read is done waits for it. A prefetched entry is reserved for its request
until the request is admitted (`release`): the policy does not see it, so blocks the device evicts meanwhile
cannot push it back out (when only reserved entries are left, such a block goes straight to the disk tier).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable

import torch

from lab_utils.engine.kv.block_copies import BlockCopies
from lab_utils.engine.kv.disk_tier import DiskTier
from lab_utils.engine.kv.kv_cache import KVCache
from lab_utils.engine.kv.tier import STATS_WHEN_OFF, Saved, tier_stats


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

    def tracked(self) -> set[Hashable]:
        """The names it may choose from: exactly the tier's unreserved entries while the books are right."""
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

    def tracked(self) -> set[Hashable]:
        return set(self.order)


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

    def tracked(self) -> set[Hashable]:
        return set(self.probation) | set(self.protected)


# `EngineConfig.kv_offload_policy` -> the host tier's eviction policy
POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy, "2q": TwoQueuePolicy}


@dataclass
class Entry:
    token_ids: tuple[int, ...]  # the block's tokens: a name with other tokens is a collision, never a hit
    saved: Saved | None  # None while `pending`
    nbytes: int
    pending: Future | None = None  # a prefetch still reading the block from disk: its result is `saved`
    prefetched: bool = False  # came up from the disk tier ahead of its lookup


class HostTier:
    """Blocks the device pool evicted, by name, within `capacity_bytes` of host memory (a `tier.Tier`).

    `copy_out(block_id) -> Saved` and `copy_in(block_id, saved)` move one block's K/V between the device cache and
    host tensors (`for_cache` passes `block_copies.BlockCopies`' methods, bound to the engine's cache). `disk`: the
    tier that receives the entries this one drops (None: they are gone). `pin`: a function applied to blocks read
    from disk by a prefetch (on CUDA, `Tensor.pin_memory`, so that their copy to the device is asynchronous)."""

    kind = "host"
    # it runs inside the engine's own prefix walk and eviction: a learner's match_prefix or evict never calls it
    excluded_parts = ("block_manager.match_prefix", "block_manager.evict")

    @classmethod
    def for_cache(cls, kv_cache: KVCache, capacity_bytes: int, policy: EvictionPolicy | None = None,
                  disk: DiskTier | None = None) -> "HostTier":
        """A tier over `kv_cache`'s blocks (pinned memory and a side stream for copies back on CUDA);
        `block_copies` is the copier, whose counters a test or a benchmark may read."""
        copies = BlockCopies(kv_cache)
        tier = cls(capacity_bytes, copies.copy_out, copies.copy_in, policy, disk=disk,
                   pin=copies.pin if copies.cuda else None)
        tier.block_copies = copies
        return tier

    def __init__(self, capacity_bytes: int, copy_out: Callable[[int], Saved], copy_in: Callable[[int, Saved], None],
                 policy: EvictionPolicy | None = None, disk: DiskTier | None = None,
                 pin: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.copy_out, self.copy_in = copy_out, copy_in
        self.policy = policy if policy is not None else LRUPolicy()
        self.disk, self.pin = disk, pin
        self.block_copies: BlockCopies | None = None  # the copier, when built by `for_cache`
        self.entries: dict[Hashable, Entry] = {}
        self.bytes_used = 0
        # counters, in blocks and bytes: out = device -> host, in = host -> device
        self.hits = self.blocks_out = self.bytes_out = self.blocks_in = self.bytes_in = 0
        self.dropped = 0  # entries dropped to make room (to the disk tier, if there is one)
        self.seconds_out = self.seconds_in = 0.0  # the engine thread's time in copies out and in (issuing them)
        self.peak_bytes = 0
        # the prefetch: blocks read up from disk ahead of their lookup, hits on them, seconds lookups waited
        self.prefetched = self.prefetch_hits = 0
        self.prefetch_wait_seconds = 0.0
        self._reader: ThreadPoolExecutor | None = None  # one background thread, made at the first prefetch
        self.reserved: dict[Hashable, list[Hashable]] = {}  # request id -> the names prefetched for it
        self._reserved: dict[Hashable, Hashable] = {}  # name -> the request it is held for, out of the policy's sight

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: Hashable) -> bool:
        return name in self.entries

    def holds(self, name: Hashable, token_ids: tuple[int, ...]) -> bool:
        """True if the tier (or the disk tier under it) has the block named `name` with exactly these tokens."""
        e = self.entries.get(name)
        if e is not None:
            return e.token_ids == token_ids
        return self.disk is not None and self.disk.holds(name, token_ids)

    def offload(self, block_id: int, name: Hashable, token_ids: tuple[int, ...]) -> None:
        """The device is about to reuse `block_id`, which holds the block `name`: keep a host copy of its K/V,
        dropping entries (the policy's victims) until it fits. A block larger than the whole tier is not kept."""
        self._remove(name)
        if self.disk is not None:
            self.disk._remove(name)  # one name, one place
        t0 = time.perf_counter()
        saved = self.copy_out(block_id)
        self.seconds_out += time.perf_counter() - t0
        nbytes = sum(t.nbytes for t in saved.values())
        if nbytes > self.capacity_bytes:
            if self.disk is not None:
                self.disk.put(name, token_ids, saved)
            return
        if not self._make_room(nbytes):  # only reserved entries left: the block goes to the disk tier
            if self.disk is not None:
                self.disk.put(name, token_ids, saved)
            return
        self._insert(name, Entry(token_ids, saved, nbytes))
        self.blocks_out += 1
        self.bytes_out += nbytes

    def _make_room(self, nbytes: int) -> bool:
        """Drop the policy's victims (to the disk tier, if any) until `nbytes` more fit; False if only reserved
        entries are left before they do."""
        while self.bytes_used + nbytes > self.capacity_bytes:
            if self._reserved and len(self.entries) <= len(self._reserved):
                return False
            victim = self.policy.victim()
            if victim not in self.entries:  # else the loop would drop nothing, forever
                raise RuntimeError(f"the host tier's eviction policy {type(self.policy).__name__} chose {victim!r}, "
                                   f"an entry the tier does not hold: an entry leaves the tier only through "
                                   f"offload, take or a drop, and each tell the policy (removed); a block taken "
                                   f"out of tier.entries directly leaves the policy a stale name")
            e = self.entries[victim]
            self._remove(victim)
            self.dropped += 1
            if self.disk is not None:
                self.disk.put(victim, e.token_ids, self._resolve(e))
        return True

    def _insert(self, name: Hashable, entry: Entry, owner: Hashable | None = None) -> None:
        self.entries[name] = entry
        self.bytes_used += entry.nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes_used)
        if owner is None:
            self.policy.inserted(name)
        else:
            self._reserve(name, owner)

    def _reserve(self, name: Hashable, owner: Hashable) -> None:
        self._reserved[name] = owner
        self.reserved.setdefault(owner, []).append(name)

    def _resolve(self, e: Entry) -> Saved:
        """An entry's K/V, waiting for its prefetch if it is still being read."""
        if e.pending is not None:
            t0 = time.perf_counter()
            e.saved, e.pending = e.pending.result(), None
            self.prefetch_wait_seconds += time.perf_counter() - t0
        return e.saved

    def take(self, name: Hashable, token_ids: tuple[int, ...]) -> Saved | None:
        """A hit leaves the tier (exclusive): its K/V for `restore`, or None if the tier does not hold it. A
        block only the disk tier holds is read from disk (it leaves the disk tier) and returned as well."""
        e = self.entries.get(name)
        if e is None or e.token_ids != token_ids:
            if e is None and self.disk is not None and self.disk.holds(name, token_ids):
                self.policy.removed(name, True)  # the name came back (2Q's history), though from the disk tier
                return self.disk.take(name, token_ids)
            return None
        self._remove(name, hit=True)
        self.hits += 1
        self.blocks_in += 1
        self.bytes_in += e.nbytes
        self.prefetch_hits += e.prefetched
        return self._resolve(e)

    def prefetch(self, blocks: Iterable[tuple[Hashable, tuple[int, ...]]], owner: Hashable = None) -> int:
        """Start reading, on a background thread, the disk tier's copies of these blocks (a prompt's prefix,
        `(name, token_ids)` in order) into this tier, as far as they fit in it, reserved for `owner` (a request
        id) until `release(owner)`; returns how many. Called on the engine's thread when a request is added; the
        thread only reads (each block's slot is claimed first)."""
        if self.disk is None or not len(self.disk):
            return 0
        reserved_bytes, started = sum(self.entries[n].nbytes for n in self._reserved), 0
        for name, ids in blocks:
            e = self.entries.get(name)
            if e is not None:  # here already: reserved too, so the reads that follow do not push it to disk
                if e.token_ids == ids and name not in self._reserved:
                    self.policy.removed(name, False)
                    self._reserve(name, owner)
                    reserved_bytes += e.nbytes
                continue
            if not self.disk.holds(name, ids):
                continue
            nbytes = self.disk.entries[name].nbytes
            if reserved_bytes + nbytes > self.capacity_bytes:
                break  # the rest of the tier is reserved already
            reserved_bytes += nbytes
            claimed = self.disk.claim(name, ids)  # first: the victims that make room go to the disk tier
            self._make_room(nbytes)
            if self._reader is None:
                self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-disk-prefetch")
            pending = self._reader.submit(self._read, claimed)
            self._insert(name, Entry(ids, None, nbytes, pending, prefetched=True), owner)
            self.prefetched += 1
            started += 1
        return started

    def release(self, owner: Hashable) -> None:
        """`owner` was admitted (or ended): what was prefetched for it and not taken becomes an ordinary entry
        (the policy's newest), the policy's to drop."""
        for name in self.reserved.pop(owner, ()):
            if name in self._reserved and self._reserved[name] == owner:
                del self._reserved[name]
                self.policy.inserted(name)

    def _read(self, claimed) -> Saved:
        saved = self.disk.read_claimed(claimed)
        return {k: self.pin(t) for k, t in saved.items()} if self.pin is not None else saved

    def drain(self) -> None:
        """Wait for every prefetch in flight (before a leak check, or closing)."""
        for e in self.entries.values():
            self._resolve(e)
        if self._reader is not None:  # reads of entries replaced meanwhile: the one thread works in order
            self._reader.submit(lambda: None).result()

    def books(self) -> str:
        """'' when the books are right: bytes counted = bytes held, within capacity, and the disk tier's too."""
        self.drain()
        held = sum(e.nbytes for e in self.entries.values())
        if held != self.bytes_used or self.bytes_used > self.capacity_bytes:
            return f"host tier: {self.bytes_used} bytes counted, {held} held, capacity {self.capacity_bytes}"
        if self._reserved:
            return f"host tier: {len(self._reserved)} prefetched entries still reserved for requests {list(self.reserved)}"
        tracked = self.policy.tracked()
        if tracked != set(self.entries) - set(self._reserved):
            return f"host tier: its policy tracks {len(tracked)} names, the tier holds {len(self.entries)} " \
                   f"({len(self._reserved)} reserved)"
        if self.disk is not None:
            if set(self.disk.entries) & set(self.entries):
                return "a name is held by both the host tier and the disk tier"
            return self.disk.books()
        return ""

    def close(self) -> None:
        """Finish the prefetches, drop every entry, and remove the disk tier's files."""
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
        self.entries.clear()
        self.reserved.clear()
        self._reserved.clear()
        self.bytes_used = 0
        if self.disk is not None:
            self.disk.close()

    def restore(self, block_id: int, saved: Saved) -> None:
        """Copy a block taken from the tier into device block `block_id`."""
        t0 = time.perf_counter()
        self.copy_in(block_id, saved)
        self.seconds_in += time.perf_counter() - t0

    def _remove(self, name: Hashable, hit: bool = False) -> None:
        e = self.entries.pop(name, None)
        if e is None:
            return
        self.bytes_used -= e.nbytes
        if name in self._reserved:  # the policy never saw it; a hit still tells it the name came back
            del self._reserved[name]
            if hit:
                self.policy.removed(name, True)
        else:
            self.policy.removed(name, hit)

    def stats(self) -> dict[str, float]:
        return {**tier_stats("host", hits=self.hits, blocks_in=self.blocks_in, bytes_in=self.bytes_in,
                             seconds_in=self.seconds_in, blocks_out=self.blocks_out, bytes_out=self.bytes_out,
                             seconds_out=self.seconds_out, entries=len(self.entries), bytes=self.bytes_used,
                             capacity_bytes=self.capacity_bytes, dropped=self.dropped,
                             extra={"prefetched": self.prefetched, "prefetch_hits": self.prefetch_hits,
                                    "prefetch_wait_seconds": self.prefetch_wait_seconds}),
                **(self.disk.stats() if self.disk is not None else
                   {k: v for k, v in STATS_WHEN_OFF.items() if k.startswith("disk_tier_")})}


def host_tier_for(config, kv_cache: KVCache) -> HostTier | None:
    """The host tier an `EngineConfig` asks for (`kv_offload_bytes`, `kv_offload_policy`, a disk tier of
    `kv_offload_disk_bytes` under `kv_offload_disk_path`), over `kv_cache`'s blocks; None when it asks for none."""
    if not config.kv_offload_bytes:
        return None
    disk = (DiskTier(config.kv_offload_disk_bytes, config.kv_offload_disk_path)
            if config.kv_offload_disk_bytes else None)
    return HostTier.for_cache(kv_cache, config.kv_offload_bytes, POLICIES[config.kv_offload_policy](), disk)
