"""Paged KV memory (lab 02, vLLM's PagedAttention, the allocator side).

A sequence's K and V live in fixed-size blocks anywhere in one pool; its `block_table` maps logical block i
(tokens i*B .. i*B+B-1) to a physical block, so token p of the sequence sits in cache slot `slot(table, p, B)`.
Blocks are handed out on demand and reference-counted, so that requests sharing a prefix can share blocks (the
prefix cache, `prefix_cache.py`, decides what a block nobody references becomes: free, or kept for reuse).

Everything that turns positions into slots, or tokens into bytes, uses the two helpers here:
- `slot(block_table, position, block_size)`: where a token's K/V lives;
- `bytes_per_token(layers, kv_heads, head_dim, store_dtype)`: what one token costs in the cache, exactly what
  `KVCache` allocates for it (int8 adds one `KV_SCALE_DTYPE` scale per K and V vector). It and the cache's
  formats (`KV_CACHE_DTYPES`) are defined with the number formats, `lab_utils.quant.kv_formats`, so that lab
  05's precision study counts the same bytes without importing the engine.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

# the cache's formats and a token's bytes (`bytes_per_token`): defined with the number formats, used here
from lab_utils.quant.kv_formats import KV_CACHE_DTYPES, KV_SCALE_DTYPE, bytes_per_token  # noqa: F401

if TYPE_CHECKING:
    from lab_utils.engine.request import Request


def slot(block_table, position, block_size: int):
    """The cache slot of token `position`: offset `position % block_size` of block `block_table[position //
    block_size]`. Elementwise on tensors: a tensor of positions gives their slots, and a [B, blocks] tensor of
    block tables with positions [L] gives [B, L]."""
    if isinstance(block_table, torch.Tensor):
        return block_table[..., position // block_size] * block_size + position % block_size
    return block_table[position // block_size] * block_size + position % block_size


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens (the last one possibly part full)."""
    return -(-num_tokens // block_size)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # the prefix cache's name for the block's contents (None: unnamed)
    token_ids: tuple[int, ...] = field(default=())  # kept to guard against hash collisions


class BlockPool:
    """The allocator: `num_blocks` blocks, a free list, and a reference count per block.

    A block is free (in `free_ids`), in use (ref count > 0), or cached: nobody references it but it still holds
    a named prefix (in `evictable`, least recently used first). A fresh block is a free one, else a cached one
    taken out of the cache (`evict`). Dropping the last reference hands the block to `recycle`. `recycle` and
    `evict` are the prefix cache's (`prefix_cache.PrefixCache`), mixed in by `BlockManager`."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives block 0 first
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but holding a cached prefix, LRU order

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_needed(num_tokens, self.block_size)

    def take_block(self) -> int:
        """A block for new tokens: a free one, else the least recently used cached one. Its ref count is 1."""
        bid = self.free_ids.pop() if self.free_ids else self.evict()
        if self.blocks[bid].ref_count != 0:
            from lab_utils.engine.replaceable import LearnerPartError

            raise LearnerPartError(f"block {bid} was handed out while {self.blocks[bid].ref_count} reference(s) "
                                   f"still use it: only blocks with ref_count 0 may be reused or evicted")
        self.blocks[bid].ref_count = 1
        return bid

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

    def check_all_free(self) -> None:
        """Leak check: every block has ref count 0 and is free or evictable."""
        leaked = [b.block_id for b in self.blocks if b.ref_count != 0]
        assert not leaked, f"{len(leaked)} KV blocks still referenced: {leaked[:10]}"
        assert self.num_free_blocks == self.num_blocks, f"{self.num_blocks - self.num_free_blocks} blocks lost"
