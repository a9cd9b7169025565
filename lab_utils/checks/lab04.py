"""Checks for lab 04's exercise: the chained hash that names each full KV block for the prefix cache.

The check runs the learner's function on fresh random token lists, compares with the engine's own hashing, and
raises AssertionError saying what differs (and what a known mistake looks like). It never shows the reference.
"""
from __future__ import annotations

import random
from typing import Callable

from lab_utils.engine.block_manager import block_hash


def _reference(token_ids: list[int], block_size: int) -> list[int]:
    out, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = block_hash(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        out.append(parent)
    return out


def check_block_hashes(fn: Callable, seed: int | None = None, cases: int = 30) -> None:
    """`fn(token_ids, block_size) -> [hash of full block 0, hash of full block 1, ...]`, each hash being
    `block_hash(parent_hash, tuple(block_token_ids))` with `parent_hash=None` for block 0."""
    rng = random.Random(seed if seed is not None else random.randrange(1 << 30))
    for i in range(cases):
        bs = rng.choice([1, 2, 4, 8, 16])
        n = rng.randint(0, 6 * bs) if i else 3 * bs + 1  # case 0 always ends in a partial block
        ids = [rng.randrange(49152) for _ in range(n)]
        want = _reference(ids, bs)
        got = fn(list(ids), bs)
        where = f"(case {i}: {n} tokens, block_size={bs})"
        if got is None:
            raise AssertionError(f"block_hashes returned None; return a list with one hash per full block {where}")
        got = list(got)
        if len(got) != len(want):
            extra = ""
            if len(got) == -(-n // bs):
                extra = " (a partial last block must not be hashed: its tokens will still change)"
            raise AssertionError(f"{len(got)} hashes for {n} tokens but there are {len(want)} full blocks{extra} {where}")
        for j, (g, w) in enumerate(zip(got, want)):
            if g == w:
                continue
            block = tuple(ids[j * bs:(j + 1) * bs])
            diag = ""
            if g == block_hash(None, block):
                diag = (" — it equals the hash of this block alone: chain it to the previous block's hash, or two "
                        "prompts that differ earlier would share this block's (different) K/V")
            elif j and g == block_hash(tuple(ids[(j - 1) * bs:j * bs]), block):
                diag = " — you chained the previous block's token ids, not its hash (the chain must cover the whole prefix)"
            elif g == hash(block):
                diag = " — use block_hash(parent_hash, token_ids), not hash(token_ids)"
            raise AssertionError(f"hash of block {j} is {g}, expected {w}{diag} {where}")
    # equal prefixes give equal hashes, different earlier blocks give different later hashes
    a = fn([1, 2, 3, 4, 5, 6], 2)
    b = fn([9, 2, 3, 4, 5, 6], 2)
    if a[2] == b[2]:
        raise AssertionError("[1,2,3,4,5,6] and [9,2,3,4,5,6] got the same hash for block 2: the chain is broken")
    print(f"check_block_hashes passed ({cases} random cases)")
