"""Attention over a paged KV cache.

Two implementations of the same maths:
- `paged_attention_reference`: one sequence at a time, gathering its keys block by block through its block
  table. Slow and obvious: the version to read, and the oracle in tests.
- `PagedAttention`: the engine's batched path. Once per step it builds `AttentionMetadata` (where new K/V go,
  which slots each sequence reads, a causal mask over the cached prefix); every layer then does one gather
  and one `scaled_dot_product_attention` for the whole ragged batch (prefill chunks and decodes mixed).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
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
              block_size: int, device: torch.device, slots_fn=None) -> AttentionMetadata:
        """`slots_fn`: a learner's `slot_mapping` (lab 02) in place of the vectorised one below.

        The host side is a few numpy calls whose results travel in one int64 buffer (one host-to-device copy);
        the slots and the mask are then computed on the device."""
        B, Q, L = len(context_lens), max(query_lens), max(context_lens)
        nblk = -(-L // block_size)  # blocks that hold positions 0..L-1 (a table may hold more: never read)
        ctx = np.asarray(context_lens, dtype=np.int64)
        qlen = np.asarray(query_lens, dtype=np.int64)
        j = np.arange(Q)
        valid_q = j[None, :] < qlen[:, None]
        qpos = np.where(valid_q, (ctx - qlen)[:, None] + j[None, :], 0)  # padded queries look at key 0 (never NaN)
        starts = np.cumsum(qlen) - qlen
        query_index = np.where(valid_q, starts[:, None] + j[None, :], 0)
        b_idx, j_idx = np.nonzero(valid_q)
        host = np.concatenate([padded_tables(block_tables, nblk).ravel(), qpos.ravel(), query_index.ravel(),
                               b_idx * Q + j_idx, b_idx, qpos[b_idx, j_idx]])
        packed = torch.from_numpy(host).to(device)
        sizes = [B * nblk, B * Q, B * Q, len(b_idx), len(b_idx), len(b_idx)]
        tables, qpos_d, query_index_d, unpad_index, tok_seq, tok_pos = packed.split(sizes)
        keys = torch.arange(L, device=device)
        all_slots = slot(tables.view(B, nblk), keys, block_size)  # [B, L]: every sequence's slots of 0..L-1
        qpos_d = qpos_d.view(B, Q)
        slot_mapping = all_slots[tok_seq, tok_pos]
        if slots_fn is not None:
            slot_mapping = checked_slots(slots_fn(block_tables, context_lens, query_lens, block_size),
                                         slot_mapping.cpu(), block_tables, context_lens, query_lens).to(device)
        mask = (keys[None, None, :] <= qpos_d[:, :, None]).unsqueeze(1)
        return cls(
            slot_mapping=slot_mapping,
            context_slots=all_slots,
            query_index=query_index_d.view(B, Q),
            unpad_index=unpad_index,
            mask=mask,
            decode_only=Q == 1,
        )


def padded_tables(block_tables: list[list[int]], width: int) -> np.ndarray:
    """The block tables as one int64 array [B, width]: each row's first `width` blocks, padded with block 0 (its
    slots are masked out). One flat pass over the ids, not a Python list per row."""
    lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int64, count=int(lens.sum()))
    rows = np.repeat(np.arange(len(block_tables)), lens)
    cols = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
    keep = cols < width
    out = np.zeros((len(block_tables), width), dtype=np.int64)
    out[rows[keep], cols[keep]] = flat[keep]
    return out


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
