"""Paged attention for mixed steps, split into a decode group and a prefill group (issue #13).

`PagedAttention` lays a step out as [B sequences, Q = longest query] and runs one SDPA over it. In a mixed
step (vLLM V1's token budget: 31 decodes + one 96-token prefill chunk) every decode row is then padded to 96
queries: 31 x 95 query rows of wasted attention, every layer. Here the step is split once into
- the decode rows (one query each): one SDPA of [D, 1] queries over their own contexts, and
- the prefill chunks: one SDPA over [P, longest chunk],
and the two results are put back in the step's token order. Same maths as `PagedAttention`, same callable.
Steps that are all-decode or all-prefill have nothing to split and use `PagedAttention` unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lab_utils.engine.attention import AttentionMetadata, PagedAttention
from lab_utils.engine.kv_cache import KVCache


@dataclass
class SplitMetadata:
    decode: AttentionMetadata
    prefill: AttentionMetadata
    decode_rows: torch.Tensor  # [D] flat token index of each decode row
    prefill_rows: torch.Tensor  # [P tokens] flat token index of each prefill token, in order

    @classmethod
    def build(cls, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
              block_size: int, device: torch.device) -> SplitMetadata | None:
        """None when the step is not mixed (nothing to gain)."""
        is_dec = [q == 1 for q in query_lens]
        if all(is_dec) or not any(is_dec):
            return None
        dec_rows, pre_rows, start = [], [], 0
        for q, d in zip(query_lens, is_dec):
            (dec_rows if d else pre_rows).extend(range(start, start + q))
            start += q

        def pick(xs, want):
            return [x for x, d in zip(xs, is_dec) if d == want]

        return cls(
            decode=AttentionMetadata.build(pick(block_tables, True), pick(context_lens, True),
                                           pick(query_lens, True), block_size, device),
            prefill=AttentionMetadata.build(pick(block_tables, False), pick(context_lens, False),
                                            pick(query_lens, False), block_size, device),
            decode_rows=torch.tensor(dec_rows, dtype=torch.long, device=device),
            prefill_rows=torch.tensor(pre_rows, dtype=torch.long, device=device),
        )


class SplitPagedAttention:
    """The `attention` callable for a mixed step: decode rows and prefill chunks attend separately."""

    def __init__(self, cache: KVCache, meta: SplitMetadata) -> None:
        self.meta = meta
        self.decode, self.prefill = PagedAttention(cache, meta.decode), PagedAttention(cache, meta.prefill)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m = self.meta
        out = torch.empty_like(q)
        # each group writes its own tokens' K/V, then reads its own sequences' context (disjoint sequences)
        for rows, attn in ((m.decode_rows, self.decode), (m.prefill_rows, self.prefill)):
            out[:, rows] = attn(layer_idx, q[:, rows], k[:, rows], v[:, rows])
        return out
