"""The prefix cache (lab 04): prompts that start alike share the KV blocks of their common start.

A full block is named by a hash chained over its parent block's name and its own token ids, so equal names mean
equal prefixes. A new prompt walks its full blocks, name by name, and attaches every block the cache already
holds instead of computing it again. A block nobody references any more is not wiped while it holds a named
prefix: it waits in an LRU list (`evictable`) and is reused on a hit, or evicted (oldest first) when the pool
needs a fresh block.

`PrefixCache` is what the block manager asks of a cache; `HashChainPrefixCache` is the engine's (vLLM's
automatic prefix caching; with `enable_prefix_caching` off it finds and names nothing). It is a mixin of the
block manager: its state is the block manager's (`blocks`, `free_ids`, `evictable`, `hash_to_block`, and
`host_tier`: None, or the `tier.Tier` under the cache), which is also what a learner's `match_prefix(self, req)`
reads and writes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from lab_utils.engine.kv.tier import prompt_block_names

if TYPE_CHECKING:
    from lab_utils.engine.request import Request


def block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block = hash(parent block's hash, this block's token ids): a chain over the whole prefix."""
    return hash((parent_hash, token_ids))


class PrefixCache:
    """What the block manager asks of a prefix cache."""

    def match_prefix(self, req: Request) -> list[int]:
        """Physical blocks already holding this prompt's leading full blocks."""
        raise NotImplementedError

    def commit_full_blocks(self, req: Request) -> None:
        """Make the blocks of `req` that just became full findable by later prompts."""
        raise NotImplementedError

    def recycle(self, bid: int) -> None:
        """A block nobody references any more: keep it cached, or free it."""
        raise NotImplementedError

    def evict(self) -> int:
        """Take a cached block out of the cache (the pool needs a fresh one); returns its id."""
        raise NotImplementedError

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    def hit_rate(self) -> float:
        """Share of admitted prompt tokens whose KV came from the cache."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class HashChainPrefixCache(PrefixCache):
    """Blocks named by chained hashes (`hash_to_block`: name -> block), unreferenced ones kept in LRU order.
    With `enable_prefix_caching` off it finds and names nothing: a released block is free at once."""

    def hash_block(self, parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
        """A full block's name: its parent's name and its own token ids, so equal names mean equal prefixes."""
        return block_hash(parent_hash, token_ids)

    def match_prefix(self, req: Request) -> list[int]:
        """Physical blocks already holding this prompt's leading full blocks. At least one prompt token is
        always left to compute, because the step that computes it produces the logits we sample from."""
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return []  # a request that wants its prompt's logprobs computes every prompt position
        hits = []
        for name, ids in prompt_block_names(self.hash_block, req.prompt_token_ids, self.block_size,
                                            (req.num_prompt_tokens - 1) // self.block_size):
            bid = self.hash_to_block.get(name)
            if bid is None:
                bid = self.promote(name, ids, hits)  # from the tier under the cache, if it holds the block
            if bid is None or self.blocks[bid].token_ids != ids:  # a collision is a miss, never a wrong hit
                break
            hits.append(bid)
        return hits

    def promote(self, name: int, ids: tuple[int, ...], hits: list[int]) -> int | None:
        """The device misses block `name` but the host tier holds it: copy it into a device block, named and
        cached (unreferenced, newest in LRU order) as if it had never left; returns that block, or None (no
        tier, the tier misses, or no device block to spare without evicting one of `hits`)."""
        tier = self.host_tier
        if tier is None or not tier.holds(name, ids):
            return None
        if not self.free_ids:  # the new block evicts a cached one: never one of this prefix's blocks
            in_hits = [b for b in hits if b in self.evictable]
            if len(self.evictable) <= len(in_hits):
                return None
            for b in in_hits:
                self.evictable.move_to_end(b)
        saved = tier.take(name, ids)  # before take_block: its eviction may offload, and the tier drop entries
        bid = self.take_block()
        tier.restore(bid, saved)
        blk = self.blocks[bid]
        blk.ref_count, blk.hash, blk.token_ids = 0, name, ids
        self.hash_to_block[name] = bid
        self.evictable[bid] = None
        return bid

    def recycle(self, bid: int) -> None:
        """A block nobody references any more: keep it (LRU order) while it holds a named prefix, else free it."""
        blk = self.blocks[bid]
        if blk.hash is not None and self.hash_to_block.get(blk.hash) == bid:
            self.evictable[bid] = None  # newest at the end: evict() takes from the front
        else:
            blk.hash, blk.token_ids = None, ()
            self.free_ids.append(bid)

    def evict(self) -> int:
        """Take the least recently used cached block out of the cache; returns its id (now unnamed)."""
        bid, _ = self.evictable.popitem(last=False)
        blk = self.blocks[bid]
        if self.hash_to_block.get(blk.hash) == bid:
            del self.hash_to_block[blk.hash]
            if self.host_tier is not None:  # its K/V is still intact: the tier keeps it
                self.host_tier.offload(bid, blk.hash, blk.token_ids)
        blk.hash, blk.token_ids = None, ()
        return bid

    def commit_full_blocks(self, req: Request) -> None:
        """Name every block that just became full (its tokens are computed), so later prompts can reuse it.

        The named blocks of a request are always the first ones of its table (committed in order, or hits of
        `match_prefix`; a block keeps its name while referenced), so the walk goes back from the last full block
        to the first unnamed one: O(new blocks) per call, not O(context)."""
        if not self.enable_prefix_caching:
            return
        n_full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        hashes = req.block_hashes  # computed once per block over the request's life
        while len(hashes) < n_full:
            i = len(hashes)
            ids = tuple(req.token_ids[i * self.block_size:(i + 1) * self.block_size])
            hashes.append((self.hash_block(hashes[-1][0] if hashes else None, ids), ids))
        first = n_full  # the first unnamed full block
        while first > 0 and self.blocks[req.block_table[first - 1]].hash is None:
            first -= 1
        for i in range(first, n_full):  # in order: a repeated name stays with its first block
            blk = self.blocks[req.block_table[i]]
            blk.hash, blk.token_ids = hashes[i]
            self.hash_to_block.setdefault(blk.hash, blk.block_id)
