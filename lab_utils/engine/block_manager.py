"""The paged KV cache's bookkeeping (vLLM's PagedAttention, the allocator side).

A sequence's KV lives in fixed-size blocks anywhere in one pool; its `block_table` maps logical block i
(tokens i*B .. i*B+B-1) to a physical block. Blocks are reference-counted so that requests sharing a prefix
share blocks (prefix caching): a full block is named by a hash chained over its parent's hash and its own
token ids, so equal hashes mean equal prefixes. A freed block that holds a cached prefix is not wiped: it waits
in an LRU list and is reused on a hit, or evicted (oldest first) when a fresh block is needed.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from lab_utils.engine.request import Request, Status


def block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block = hash(parent block's hash, this block's token ids): a chain over the whole prefix."""
    return hash((parent_hash, token_ids))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default=())  # kept to guard against hash collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 watermark: float = 0.01) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives block 0 first
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but holding a cached prefix, LRU order
        self.hash_to_block: dict[int, int] = {}
        # prefix-cache statistics, in prompt tokens
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- capacity ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache (lab 04) ------------------------------------------------------------------
    def hash_block(self, parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
        """A full block's name: its parent's name and its own token ids, so equal names mean equal prefixes."""
        return block_hash(parent_hash, token_ids)

    def match_prefix(self, req: Request) -> list[int]:
        """Physical blocks already holding this prompt's leading full blocks. At least one prompt token is
        always left to compute, because the step that computes it produces the logits we sample from."""
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return []  # a request that wants its prompt's logprobs computes every prompt position
        hits, parent = [], None
        for i in range((req.num_prompt_tokens - 1) // self.block_size):
            ids = tuple(req.prompt_token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent = self.hash_block(parent, ids)
            bid = self.hash_to_block.get(parent)
            if bid is None or self.blocks[bid].token_ids != ids:  # a collision is a miss, never a wrong hit
                break
            hits.append(bid)
        return hits

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
        blk.hash, blk.token_ids = None, ()
        return bid

    def commit_full_blocks(self, req: Request) -> None:
        """Name every block that just became full (its tokens are computed), so later prompts can reuse it."""
        if not self.enable_prefix_caching:
            return
        n_full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        hashes = req.block_hashes  # computed once per block over the request's life
        while len(hashes) < n_full:
            i = len(hashes)
            ids = tuple(req.token_ids[i * self.block_size:(i + 1) * self.block_size])
            hashes.append((self.hash_block(hashes[-1][0] if hashes else None, ids), ids))
        for i in range(n_full):
            blk = self.blocks[req.block_table[i]]
            if blk.hash is None:
                blk.hash, blk.token_ids = hashes[i]
                self.hash_to_block.setdefault(blk.hash, blk.block_id)

    # -- allocation (lab 02) ----------------------------------------------------------------------
    def take_block(self) -> int:
        """A block for new tokens: a free one, else the least recently used cached one. Its ref count is 1."""
        bid = self.free_ids.pop() if self.free_ids else self.evict()
        if self.blocks[bid].ref_count != 0:
            from lab_utils.course.parts import LearnerPartError

            raise LearnerPartError(f"block {bid} was handed out while {self.blocks[bid].ref_count} reference(s) "
                                   f"still use it: only blocks with ref_count 0 may be reused or evicted")
        self.blocks[bid].ref_count = 1
        return bid

    def can_admit(self, req: Request, num_new_tokens: int) -> bool:
        """Enough free blocks for a waiting request's first chunk, keeping the watermark for running ones."""
        # only a fresh admission attaches cached blocks (see `admit`); a swapped-out request brings its own KV
        fresh = not req.block_table and req.status is not Status.SWAPPED
        hits = self.match_prefix(req) if fresh else []
        reusable_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        total = max(req.num_computed_tokens, len(hits) * self.block_size) + num_new_tokens
        need = self.blocks_needed(total) - len(hits) - len(req.block_table) + reusable_free
        return self.num_free_blocks - need >= self.watermark_blocks

    def admit(self, req: Request) -> int:
        """Attach cached prefix blocks to a newly scheduled request; returns the number of cached tokens."""
        if req.block_table:
            return 0
        hits = self.match_prefix(req)
        self.prefix_queries += req.num_prompt_tokens
        for bid in hits:
            self.blocks[bid].ref_count += 1
            self.evictable.pop(bid, None)  # in use again: no longer a candidate for eviction
        req.block_table = list(hits)
        cached = len(hits) * self.block_size
        self.prefix_hits += cached
        req.num_computed_tokens = max(req.num_computed_tokens, cached)
        req.num_cached_tokens = cached
        return cached

    def can_grow(self, req: Request, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(req.block_table) <= self.num_free_blocks

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Make the block table cover `num_tokens` tokens; False (and no change) if the pool is too small."""
        need = self.blocks_needed(num_tokens) - len(req.block_table)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            req.block_table.append(self.take_block())
        return True

    def release(self, bid: int) -> None:
        """Drop one reference to a block; the last one hands it to `recycle` (cached or free)."""
        blk = self.blocks[bid]
        blk.ref_count -= 1
        assert blk.ref_count >= 0, f"block {bid} freed twice"
        if blk.ref_count == 0:
            self.recycle(bid)

    def free(self, req: Request) -> None:
        """Drop the request's references (last block first, so a prompt's head stays cached longest)."""
        for bid in reversed(req.block_table):
            self.release(bid)
        req.block_table = []

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens (speculative decoding's rollback)."""
        keep = self.blocks_needed(num_tokens)
        for bid in reversed(req.block_table[keep:]):
            self.release(bid)
        del req.block_table[keep:]

    # -- checks -----------------------------------------------------------------------------------
    def check_all_free(self) -> None:
        """Leak check: every block has ref count 0 and is free or evictable."""
        leaked = [b.block_id for b in self.blocks if b.ref_count != 0]
        assert not leaked, f"{len(leaked)} KV blocks still referenced: {leaked[:10]}"
        assert self.num_free_blocks == self.num_blocks, f"{self.num_blocks - self.num_free_blocks} blocks lost"

    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
