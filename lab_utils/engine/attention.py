"""Attention over a paged KV cache.

Two implementations of the same maths:
- `paged_attention_reference`: one sequence at a time, gathering its keys block by block through its block
  table. Slow and obvious: the version to read, and the oracle in tests.
- `PagedAttention`: the engine's batched path. Once per step it builds `AttentionMetadata` (where new K/V go,
  which slots each sequence reads, a causal mask over the cached prefix); every layer then does one gather
  and one `scaled_dot_product_attention` for the whole ragged batch (prefill chunks and decodes mixed).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lab_utils.engine.invariants import checked_slots
from lab_utils.engine.kv.kv_cache import KVCache
from lab_utils.engine.kv.paging import slot


def slot_mapping(block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
                 block_size: int) -> list[int]:
    """The cache slot of every token this step computes, in step order: sequence i's new tokens are its
    positions context_lens[i] - query_lens[i] .. context_lens[i] - 1, and position p lives in block
    block_tables[i][p // block_size] at offset p % block_size."""
    slots = []
    for table, ctx, qlen in zip(block_tables, context_lens, query_lens):
        for p in range(ctx - qlen, ctx):
            slots.append(slot(table, p, block_size))
    return slots


def gather_blocks(cache: torch.Tensor, block_table: list[int], context_len: int, block_size: int) -> torch.Tensor:
    """cache [num_slots, Hkv, D] -> this sequence's first `context_len` tokens [context_len, Hkv, D]."""
    slots = [slot(block_table, p, block_size) for p in range(context_len)]
    return cache[torch.tensor(slots, dtype=torch.long, device=cache.device)]


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
                              block_size: int) -> torch.Tensor:
    """q [N, Hq, D] holds the newest `query_lens[i]` tokens of each sequence, back to back.
    Query j of sequence i sits at position context_lens[i] - query_lens[i] + j and sees keys 0..that position."""
    outs, start = [], 0
    for table, ctx, qlen in zip(block_tables, context_lens, query_lens):
        k = gather_blocks(k_cache, table, ctx, block_size)
        v = gather_blocks(v_cache, table, ctx, block_size)
        qi = q[start:start + qlen]
        groups = qi.shape[1] // k.shape[1]  # grouped-query attention: each KV head serves `groups` query heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi.float(), k.float()) / qi.shape[-1] ** 0.5
        qpos = torch.arange(ctx - qlen, ctx, device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(ctx, device=q.device)[None, :] > qpos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype))
        start += qlen
    return torch.cat(outs)


@dataclass
class AttentionMetadata:
    """Built once per step, shared by all layers."""

    slot_mapping: torch.Tensor  # [N] slot where each new token's K/V is written
    context_slots: torch.Tensor  # [B, L] slots of each sequence's tokens 0..L-1 (padded)
    query_index: torch.Tensor  # [B, Q] flat index of each sequence's queries (padded with 0)
    unpad_index: torch.Tensor  # [N] position of flat token n in the flattened [B*Q] padded layout
    mask: torch.Tensor  # [B, 1, Q, L] True where a query may attend
    decode_only: bool

    @classmethod
    def build(cls, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
              block_size: int, device: torch.device, slots_fn=None) -> "AttentionMetadata":
        """`slots_fn`: a learner's `slot_mapping` (lab 02) in place of the vectorised one below."""
        B, Q, L = len(context_lens), max(query_lens), max(context_lens)
        nblk = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (nblk - len(t)) for t in block_tables], dtype=torch.long)
        all_slots = slot(tables, torch.arange(L), block_size)  # [B, L]: every sequence's slots of positions 0..L-1
        ctx = torch.tensor(context_lens)
        qlen = torch.tensor(query_lens)
        j = torch.arange(Q)
        qpos = (ctx - qlen)[:, None] + j[None, :]  # absolute position of each query
        valid_q = j[None, :] < qlen[:, None]
        qpos = torch.where(valid_q, qpos, torch.zeros_like(qpos))  # padded queries look at key 0 (never NaN)
        starts = torch.cumsum(qlen, 0) - qlen
        query_index = torch.where(valid_q, starts[:, None] + j[None, :], torch.zeros_like(qpos))
        b_idx, j_idx = valid_q.nonzero(as_tuple=True)
        if slots_fn is None:
            slot_mapping = all_slots[b_idx, qpos[b_idx, j_idx]]
        else:
            slot_mapping = checked_slots(slots_fn(block_tables, context_lens, query_lens, block_size),
                                         all_slots[b_idx, qpos[b_idx, j_idx]], block_tables, context_lens,
                                         query_lens)
        mask = (torch.arange(L)[None, None, :] <= qpos[:, :, None]).unsqueeze(1)
        return cls(
            slot_mapping=slot_mapping.to(device),
            context_slots=all_slots.to(device),
            query_index=query_index.to(device),
            unpad_index=(b_idx * Q + j_idx).to(device),
            mask=mask.to(device),
            decode_only=Q == 1,
        )


class PagedAttention:
    """The `attention` callable the model's layers call during an engine step."""

    def __init__(self, cache: KVCache, meta: AttentionMetadata) -> None:
        self.cache, self.meta = cache, meta

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m = self.meta
        q, k, v = q[0], k[0], v[0]  # the engine passes one flat "batch" of N tokens: [1, N, H, D]
        self.cache.write(layer_idx, m.slot_mapping, k, v)
        keys, values = self.cache.read(layer_idx, m.context_slots)  # [B, L, Hkv, D]
        qp = q[m.query_index] if not m.decode_only else q[:, None]  # [B, Q, Hq, D]
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=m.mask, enable_gqa=True
        )  # [B, Hq, Q, D]
        out = out.transpose(1, 2)
        out = out[:, 0] if m.decode_only else out.reshape(-1, *out.shape[2:])[m.unpad_index]
        return out[None]
