"""Paged attention in groups: prefill chunks apart from decode rows, and decode rows in small groups.

`PagedAttention` lays a step out as [B sequences, Q = longest query, L = longest context] and runs one gather
and one SDPA over it. Two things make that slow on a CPU, and splitting the step fixes both:
- in a mixed step (vLLM V1's token budget: 31 decodes + one 96-token prefill chunk) every decode row is padded
  to 96 queries: 31 x 95 query rows of wasted attention, every layer. So the prefill chunks attend as one group
  and the decode rows (one query each) apart;
- a big decode batch gathers K/V for B x L keys (9 MB per tensor at B = 64, L = 190) before SDPA reads it back,
  by then out of cache; and every row is padded to the longest context. So decode rows are sorted by context
  length and attend in groups of `DECODE_GROUP_ROWS`: each group's gathered K/V is still in cache when SDPA
  reads it, and each group pads only to its own longest context (measured 3-6x less attention time at B = 32-64
  on the 2-core AVX2 VM, one thread).
Same maths as `PagedAttention`, same callable; the groups write their own tokens' K/V and read their own
sequences' context (disjoint sequences). Steps with nothing to split (a few decodes, or prefill only) use
`PagedAttention` unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lab_utils.engine.attention import AttentionMetadata, PagedAttention
from lab_utils.engine.kv.kv_cache import KVCache

DECODE_GROUP_ROWS = 8


@dataclass
class SplitMetadata:
    groups: list[tuple[torch.Tensor, AttentionMetadata]]  # (flat token indices of the group, its metadata)

    @classmethod
    def build(cls, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
              block_size: int, device: torch.device, group_rows: int = DECODE_GROUP_ROWS) -> SplitMetadata | None:
        """None when there is nothing to split (at most `group_rows` decodes and no prefill, or prefill only)."""
        if group_rows < 1:
            raise ValueError(f"group_rows={group_rows} must be >= 1")
        decodes = [i for i, q in enumerate(query_lens) if q == 1]
        prefills = [i for i, q in enumerate(query_lens) if q != 1]
        if not decodes or (not prefills and len(decodes) <= group_rows):
            return None
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        decodes.sort(key=context_lens.__getitem__)  # neighbours in a group have similar contexts: little padding
        entries = [decodes[j:j + group_rows] for j in range(0, len(decodes), group_rows)]
        if prefills:
            entries.append(prefills)
        groups = []
        for group in entries:
            rows = [r for i in group for r in range(starts[i], starts[i + 1])]
            meta = AttentionMetadata.build([block_tables[i] for i in group], [context_lens[i] for i in group],
                                           [query_lens[i] for i in group], block_size, device)
            groups.append((torch.tensor(rows, dtype=torch.long, device=device), meta))
        return cls(groups)


class SplitPagedAttention:
    """The `attention` callable for a split step: each group attends on its own."""

    def __init__(self, cache: KVCache, meta: SplitMetadata) -> None:
        self.parts = [(rows, PagedAttention(cache, m)) for rows, m in meta.groups]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        for rows, attn in self.parts:
            out[:, rows] = attn(layer_idx, q[:, rows], k[:, rows], v[:, rows])
        return out
