"""The shared store under an engine's prefix cache, where the host tier would sit.

The engine's prefix walk (`prefix_cache.match_prefix`) asks its tier for a block the device misses
(`holds`, `take`, `restore`), and its eviction hands the tier a block it is about to reuse (`offload`): the
`lab_utils.engine.kv.tier.Tier` protocol. `StoreTier` answers those from the store process, so a block that one
engine computed is found by another.

Names: the engine names a block with Python's `hash` chained from `None`; `hash(None)` differs from one
process to the next up to CPython 3.11 (a constant from 3.12), and Python's `hash` is no cross-process contract,
so those names mean nothing to another process. The store keys blocks by
`stable_names`: a BLAKE2b chain over the token ids, equal in every process. The tier learns which engine name
stands for which stable name when a prompt is added (`_PromptNames`, a step hook), from the same token ids.

Publishing: with `publish=True` (a prefill worker, Mooncake's "prefill writes the KV to the store") a request's
full prompt blocks go to the store as soon as its first token exists (`_PublishOnPrefill`); every engine also
publishes a named block it evicts. What crossed the socket, and the seconds spent, are in `client.stats`.
"""
from __future__ import annotations

import functools
import hashlib
import time
from collections import OrderedDict
from typing import Hashable, Iterable

import torch

from lab_utils.engine.hooks import StepHook
from lab_utils.engine.kv.kv_cache import KVCache
from lab_utils.engine.kv.tier import Saved, attach_tier, prompt_block_names, tier_stats
from lab_utils.kvstore.store import KVStoreClient, Payload


def stable_names(token_ids, block_size: int) -> list[bytes]:
    """The names of the full blocks of `token_ids`, the same in every process: block i's name is a BLAKE2b hash
    of block i-1's name and block i's token ids (a chain, as the engine's names are)."""
    names, parent = [], b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(torch.tensor(token_ids[start:start + block_size], dtype=torch.int64).numpy().tobytes())
        parent = h.digest()
        names.append(parent)
    return names


def encode(saved: Saved) -> Payload:
    """One block's tensors as bytes for the socket (no shared memory, no file descriptors)."""
    return {name: (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
            for name, t in saved.items()}


def decode(payload: Payload) -> Saved:
    return {name: torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)
            for name, (dtype, shape, raw) in payload.items()}


class StoreTier:
    """A `Tier` over a `KVStoreClient` (shared, not exclusive: a block taken stays in the store for the next
    engine). `copy_out` / `copy_in` move one block between the device cache and host tensors."""

    kind = "store"
    # inside the engine's own prefix walk and eviction, and its names come from the engine's hash_block: a
    # learner's chain that names two prefixes alike would hand another engine's block to the wrong prompt
    excluded_parts = ("block_manager.match_prefix", "block_manager.evict", "block_manager.hash_block")

    def __init__(self, client: KVStoreClient, copy_out, copy_in, max_names: int = 1 << 16) -> None:
        self.client, self.copy_out, self.copy_in = client, copy_out, copy_in
        self.names: OrderedDict[Hashable, bytes] = OrderedDict()  # engine's name -> stable name (newest last)
        self.max_names = max_names
        self.hits = self.blocks_in = self.bytes_in = self.blocks_out = self.bytes_out = 0
        self.seconds_in = self.seconds_out = 0.0  # round trips and (de)coding, on the engine's thread

    @classmethod
    def for_cache(cls, client: KVStoreClient, kv_cache: KVCache) -> "StoreTier":
        """A tier over `kv_cache`'s blocks (copied one at a time to and from host tensors)."""
        from lab_utils.engine.engine import copy_block_in, copy_block_out

        return cls(client, functools.partial(copy_block_out, kv_cache), functools.partial(copy_block_in, kv_cache))

    def learn(self, engine_names: list[Hashable], stable: list[bytes]) -> None:
        for name, key in zip(engine_names, stable):
            self.names[name] = key
            self.names.move_to_end(name)
        while len(self.names) > self.max_names:
            self.names.popitem(last=False)

    def holds(self, name: Hashable, token_ids: tuple[int, ...]) -> bool:
        key = self.names.get(name)
        return key is not None and self.client.has(key, token_ids)

    def take(self, name: Hashable, token_ids: tuple[int, ...]) -> Saved | None:
        key = self.names.get(name)
        t0 = time.perf_counter()
        payload = None if key is None else self.client.get(key, token_ids)
        if payload is None:
            return None
        saved = decode(payload)
        self.seconds_in += time.perf_counter() - t0
        self.hits += 1
        self.blocks_in += 1
        self.bytes_in += sum(t.nbytes for t in saved.values())
        return saved

    def restore(self, block_id: int, saved: Saved) -> None:
        self.copy_in(block_id, saved)

    def put(self, block_id: int, key: bytes, token_ids: tuple[int, ...]) -> bool:
        """Publish device block `block_id` under `key` unless the store already holds it."""
        if self.client.has(key, token_ids):
            return False
        t0 = time.perf_counter()
        payload = encode(self.copy_out(block_id))
        stored = self.client.put(key, token_ids, payload)
        self.seconds_out += time.perf_counter() - t0
        if stored:
            self.blocks_out += 1
            self.bytes_out += sum(len(raw) for _, _, raw in payload.values())
        return stored

    def offload(self, block_id: int, name: Hashable, token_ids: tuple[int, ...]) -> None:
        """The device is about to reuse `block_id`: publish it (if its stable name is known), so it is not lost."""
        key = self.names.get(name)
        if key is not None:
            self.put(block_id, key, token_ids)

    def prefetch(self, blocks: Iterable[tuple[Hashable, tuple[int, ...]]], owner: Hashable) -> int:
        """Nothing read ahead: a lookup asks the store process when it comes."""
        return 0

    def release(self, owner: Hashable) -> None:
        """Nothing is held for a request."""

    def books(self) -> str:
        """'': the store keeps its books in its own process (`KVStoreProcess`)."""
        return ""

    def close(self) -> None:
        """Forget the names learned; the store's blocks stay for the other engines."""
        self.names.clear()

    def stats(self) -> dict[str, float]:
        # entries, bytes, capacity and drops are the store process's, not this engine's: 0 here
        return tier_stats("store", hits=self.hits, blocks_in=self.blocks_in, bytes_in=self.bytes_in,
                          seconds_in=self.seconds_in, blocks_out=self.blocks_out, bytes_out=self.bytes_out,
                          seconds_out=self.seconds_out, entries=0, bytes=0, capacity_bytes=0, dropped=0,
                          extra={"calls": self.client.stats.calls})


class _PromptNames(StepHook):
    """At `add_request`: tell the tier which engine name stands for which stable name, for the new prompt."""

    def __init__(self, engine, tier: StoreTier) -> None:
        self.engine, self.tier = engine, tier

    def add(self, request_id: str, state) -> None:
        req = self.engine.requests[request_id]
        bm = self.engine.block_manager
        ids, bs = list(req.prompt_token_ids), bm.block_size
        engine_names = [name for name, _ in prompt_block_names(bm.hash_block, ids, bs)]
        self.tier.learn(engine_names, stable_names(ids, bs))


class _PublishOnPrefill(StepHook):
    """A prefill worker's duty: once a request has its first token, its full prompt blocks go to the store."""

    def __init__(self, engine, tier: StoreTier) -> None:
        self.engine, self.tier = engine, tier

    def accept(self, req, token: int) -> str | None:
        if req.num_tokens == req.num_prompt_tokens + 1:  # the first token: the prompt's KV is all in blocks
            publish(self.engine, req, self.tier)
        return None


def publish(engine, req, tier: StoreTier | None = None) -> int:
    """Put `req`'s full prompt blocks in the store (those it does not hold yet); returns how many were put."""
    tier = tier if tier is not None else engine.block_manager.host_tier
    if not isinstance(tier, StoreTier):
        raise ValueError("this engine has no KV store attached: call lab_utils.kvstore.attach(engine, client) first")
    bs = engine.block_manager.block_size
    ids = list(req.prompt_token_ids)
    n_full = min(len(ids), req.num_computed_tokens) // bs
    keys = stable_names(ids[:n_full * bs], bs)
    return sum(tier.put(req.block_table[i], keys[i], tuple(ids[i * bs:(i + 1) * bs])) for i in range(n_full))


def attach(engine, client: KVStoreClient, publish: bool = False) -> StoreTier:
    """Put the store under `engine`'s prefix cache (instead of a host tier); with `publish`, the engine also
    writes every prompt's full blocks to the store when its prefill ends. Needs the engine's own prefix cache."""
    if isinstance(engine.block_manager.host_tier, StoreTier):
        detach(engine)  # a store attached again replaces the one before
    tier = attach_tier(engine.block_manager, StoreTier.for_cache(client, engine.kv_cache), engine.parts,
                       "the KV store (lab_utils.kvstore.attach)")
    engine.hooks.append(_PromptNames(engine, tier))
    if publish:
        engine.hooks.append(_PublishOnPrefill(engine, tier))
    return tier


def detach(engine) -> None:
    """Take the store from under `engine` (its prefix cache keeps what the device holds)."""
    if isinstance(engine.block_manager.host_tier, StoreTier):
        engine.block_manager.host_tier = None
    engine.hooks[:] = [h for h in engine.hooks if not isinstance(h, (_PromptNames, _PublishOnPrefill))]
