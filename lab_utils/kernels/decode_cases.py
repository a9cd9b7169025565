"""Random decode-attention cases for lab 16's kernel: shuffled block tables, ragged contexts (most with a partly
filled last block), grouped-query ratios; the expected output from `paged_attention_reference`."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from lab_utils.engine.attention import paged_attention_reference
from lab_utils.kernels.paged_decode_triton import default_scale, tables_tensor


@dataclass
class DecodeCase:
    q: torch.Tensor  # [B, Hq, D]
    k_cache: torch.Tensor  # [num_slots, Hkv, D]
    v_cache: torch.Tensor
    tables: list[list[int]]
    context_lens: list[int]
    block_size: int

    @property
    def scale(self) -> float:
        return default_scale(self.q.shape[-1])

    def args(self) -> tuple:
        """The kernel's arguments: (q, k_cache, v_cache, block_tables, context_lens, block_size, scale)."""
        return (self.q, self.k_cache, self.v_cache, tables_tensor(self.tables, self.q.device),
                torch.tensor(self.context_lens, dtype=torch.int32, device=self.q.device), self.block_size, self.scale)

    def expected(self) -> torch.Tensor:
        return paged_attention_reference(self.q, self.k_cache, self.v_cache, self.tables, self.context_lens,
                                         [1] * len(self.tables), self.block_size)

    def describe(self) -> str:
        B, Hq, D = self.q.shape
        return (f"batch {B}, {Hq} query heads on {self.k_cache.shape[1]} KV heads, head dim {D}, block_size "
                f"{self.block_size}, context_lens {self.context_lens}, block_tables {self.tables}")


def random_case(rng: random.Random, max_context: int = 40, batch: int | None = None, heads: tuple | None = None,
                block_size: int | None = None, head_dim: int | None = None, scale_q: float = 1.0,
                device: str = "cpu") -> DecodeCase:
    """One case; `heads` = (Hq, Hkv). Block ids are shuffled and the pool has spare blocks full of noise, so
    reading the wrong block or past the context shows."""
    bs = block_size or rng.choice([4, 8, 16])
    B = batch or rng.randint(1, 4)
    hq, hkv = heads or rng.choice([(2, 2), (4, 2), (4, 1), (6, 2)])
    D = head_dim or rng.choice([8, 16])
    ctx = [rng.randint(1, max_context) for _ in range(B)]
    if all(c % bs == 0 for c in ctx):
        ctx[0] = max(1, ctx[0] - 1)  # at least one partly filled last block
    need = [-(-c // bs) for c in ctx]
    num_blocks = sum(need) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    k = torch.randn(num_blocks * bs, hkv, D, generator=g)
    v = torch.randn(num_blocks * bs, hkv, D, generator=g)
    q = torch.randn(B, hq, D, generator=g) * scale_q
    return DecodeCase(q.to(device), k.to(device), v.to(device), tables, ctx, bs)
