"""The seam under the prefix cache: what the device pool asks of the tier that keeps the blocks it evicts.

The prefix walk (`prefix_cache.match_prefix`) asks the tier for a block the device misses (`holds`, `take`,
`restore`); the pool's eviction hands it a named block it is about to reuse (`offload`); a new request may have
its blocks read ahead (`prefetch`) and is admitted (`release`); the engine reports `stats` and calls `close`.
Two kinds implement it: the host tier (`host_tier.HostTier`, with its disk tier) and a store shared between
engines (`lab_utils.kvstore.StoreTier`). The engine reaches either through this protocol only.

Here too: `prompt_block_names`, the one walk that names a prompt's full blocks; `attach_tier`, the one place
that refuses a tier under a learner's prefix-cache parts; and the one stats vocabulary every tier reports in.
"""
from __future__ import annotations

from typing import (
    Callable,
    Hashable,
    Iterable,
    Iterator,
    Protocol,
    Sequence,
    runtime_checkable,
)

import torch

Saved = dict[str, torch.Tensor]  # one block's K/V as `KVCache.copy_out` returns it

# What every tier counts, in one vocabulary: `in` = tier -> device, `out` = device -> tier. The engine's stats
# name them `<kind>_tier_<field>` (host, disk, store).
TIER_STATS = ("hits", "blocks_in", "bytes_in", "seconds_in", "blocks_out", "bytes_out", "seconds_out",
              "entries", "bytes", "capacity_bytes", "dropped")


def tier_stats(kind: str, *, extra: dict | None = None, **counts: float) -> dict[str, float]:
    """`counts` (every field of `TIER_STATS`, no other) and a kind's `extra` counters as `<kind>_tier_<field>`."""
    missing, unknown = set(TIER_STATS) - set(counts), set(counts) - set(TIER_STATS)
    if missing or unknown:
        raise ValueError(f"a tier's stats are the fields of TIER_STATS: {kind} tier missing {sorted(missing)}, "
                         f"unknown {sorted(unknown)} (a counter of its own goes in extra=)")
    return {f"{kind}_tier_{k}": v for k, v in {**{k: counts[k] for k in TIER_STATS}, **(extra or {})}.items()}


def _off(kind: str, **extra: float) -> dict[str, float]:
    return tier_stats(kind, extra=extra, **{k: 0.0 if k.startswith("seconds") else 0 for k in TIER_STATS})


# every engine reports every tier's stats (tools read them without checking the config): zeros while off
HOST_EXTRA_STATS = ("prefetched", "prefetch_hits", "prefetch_wait_seconds")
STORE_EXTRA_STATS = ("calls",)
STATS_WHEN_OFF = {**_off("host", prefetched=0, prefetch_hits=0, prefetch_wait_seconds=0.0), **_off("disk"),
                  **_off("store", calls=0)}


@runtime_checkable
class Tier(Protocol):
    """What the prefix cache and the engine ask of the tier under the device pool."""

    kind: str  # "host" or "store": its stats are named `<kind>_tier_*`
    # learner parts this tier cannot run under (`attach_tier` refuses them): it works inside the engine's own
    excluded_parts: tuple[str, ...]
    hits: int  # blocks taken back to the device so far

    def holds(self, name: Hashable, token_ids: tuple[int, ...]) -> bool:
        """True if the tier has the block named `name` with exactly these tokens (a collision is a miss)."""

    def take(self, name: Hashable, token_ids: tuple[int, ...]) -> Saved | None:
        """The block's K/V for `restore` (a hit), or None."""

    def restore(self, block_id: int, saved: Saved) -> None:
        """Copy a block taken from the tier into device block `block_id`."""

    def offload(self, block_id: int, name: Hashable, token_ids: tuple[int, ...]) -> None:
        """The device is about to reuse `block_id`, which holds the block `name`: keep it if the tier can."""

    def prefetch(self, blocks: Iterable[tuple[Hashable, tuple[int, ...]]], owner: Hashable) -> int:
        """Start bringing these blocks (a new prompt's, in order) closer, held for request `owner` until
        `release(owner)`; returns how many. A tier with nothing to read ahead returns 0 without iterating."""

    def release(self, owner: Hashable) -> None:
        """Request `owner` was admitted or ended: what was held for it is ordinary again."""

    def stats(self) -> dict[str, float]:
        """Its counters, `tier_stats` of its kind (the disk tier's too, under a host tier)."""

    def books(self) -> str:
        """'' when its accounting is right, else what is wrong (a leak check)."""

    def close(self) -> None:
        """Finish background work and give back what it holds in this process (files included)."""


def prompt_block_names(hash_block: Callable[[Hashable | None, tuple[int, ...]], Hashable],
                       token_ids: Sequence[int], block_size: int,
                       limit: int | None = None) -> Iterator[tuple[Hashable, tuple[int, ...]]]:
    """(name, token ids) of each full block of `token_ids`, in order, the first `limit` at most: block i's name
    is `hash_block(name of block i-1, its ids)`, from None. Lazy: a walk that stops early hashes no further."""
    count = len(token_ids) // block_size if limit is None else min(limit, len(token_ids) // block_size)
    parent = None
    for i in range(count):
        ids = tuple(token_ids[i * block_size:(i + 1) * block_size])
        parent = hash_block(parent, ids)
        yield parent, ids


def check_parts(tier: Tier, parts, setting: str) -> None:
    """Refuse `tier` when `parts` (the engine's) replace one it cannot run under: it works inside the engine's
    own prefix cache, so a learner's version of those methods would never call it, or call it wrongly."""
    learners = [n for n in tier.excluded_parts if parts.is_learners(n)]
    if learners:
        raise ValueError(f"{setting} works inside the engine's own {', '.join(tier.excluded_parts)}; this engine "
                         f"runs the learner's {', '.join(learners)}: turn {setting} off, or run without those parts")


def attach_tier(block_manager, tier: Tier, parts, setting: str) -> Tier:
    """Put `tier` under `block_manager`'s prefix cache (its `host_tier`), after `check_parts`; a block manager
    holds one tier. On refusal the tier is closed (its files removed) and ValueError names the fix."""
    try:
        if not block_manager.enable_prefix_caching:
            raise ValueError(f"{setting} sits under the prefix cache, which is off: build the engine with "
                             f"enable_prefix_caching=True")
        check_parts(tier, parts, setting)
        held = block_manager.host_tier
        if held is not None and held is not tier:
            raise ValueError(f"this engine has a {held.kind} tier already; {setting} would be a second one: use "
                             f"one tier under the prefix cache")
    except ValueError:
        tier.close()
        raise
    block_manager.host_tier = tier
    return tier


def prefetch_prompt(block_manager, req) -> int:
    """Ask the tier to read ahead the blocks of `req`'s prompt that its admission would look for there: those
    the device misses, up to the first the tier misses (where `match_prefix`'s walk would stop)."""
    tier = block_manager.host_tier
    if tier is None or req.params.prompt_logprobs is not None:
        return 0

    def wanted():
        for name, ids in prompt_block_names(block_manager.hash_block, req.prompt_token_ids, block_manager.block_size,
                                            (req.num_prompt_tokens - 1) // block_manager.block_size):
            if name in block_manager.hash_to_block:
                continue
            if not tier.holds(name, ids):  # the walk stops here: no later block can be a hit
                return
            yield name, ids

    return tier.prefetch(wanted(), req.request_id)
