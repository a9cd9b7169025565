"""The paged KV cache's bookkeeping: the block pool (`paging.py`) with the prefix cache (`prefix_cache.py`) on
top, and the admission arithmetic that uses both.

The scheduler asks three things of it: can a waiting request start with n tokens (`can_admit`: its cached
prefix blocks count as present, and a watermark of free blocks stays for running requests to grow into), start
it (`admit`: attach its cached prefix blocks), and grow or free a request's block table (`grow`, `free`).
"""
from __future__ import annotations

from lab_utils.engine.kv.paging import BlockPool
from lab_utils.engine.kv.prefix_cache import HashChainPrefixCache
from lab_utils.engine.kv.tier import Tier
from lab_utils.engine.request import Request, Status


class BlockManager(HashChainPrefixCache, BlockPool):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 watermark: float = 0.01, host_tier: Tier | None = None) -> None:
        super().__init__(num_blocks, block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.host_tier = host_tier  # evicted named blocks go there, and come back from there (None: gone)
        self.watermark_blocks = int(watermark * num_blocks)
        self.hash_to_block: dict[int, int] = {}  # a full block's name -> the block holding it
        # prefix-cache statistics, in prompt tokens
        self.prefix_queries = 0
        self.prefix_hits = 0

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
        if self.host_tier is not None:  # what the tier read ahead for it is ordinary now
            self.host_tier.release(req.request_id)
        self.prefix_queries += req.num_prompt_tokens
        for bid in hits:
            self.blocks[bid].ref_count += 1
            self.evictable.pop(bid, None)  # in use again: no longer a candidate for eviction
        req.block_table = list(hits)
        cached = len(hits) * self.block_size
        self.prefix_hits += cached
        req.num_computed_tokens = max(req.num_computed_tokens, cached)
        if req.metrics.first_scheduled_time is None:  # as vLLM: a re-admission after preemption keeps the first count
            req.num_cached_tokens = cached
        return cached
