"""Paged decode attention in Triton: the reference kernel of lab 16, and its split-KV (FlashDecoding) variant.

Decode attention reads every cached key and value of a sequence once per new token, so at long context it is
bound by bytes, not FLOPs. The kernel reads K/V through the block table in place (no gather into a dense copy),
keeps a running max and sum (online softmax) so one pass suffices, maps each query head to its KV head
(grouped-query attention) and masks the last, partly filled block. Split-KV runs several programs per sequence
over slices of its context and combines their outputs by their log-sum-exps: at batch 1 a single program per
head leaves most of a GPU idle.

Layouts (one layer of `KVCache`): q [B, Hq, D] (one new token per sequence), k_cache/v_cache
[num_slots, Hkv, D] with slot = block_id * block_size + offset, block_tables int32 [B, max_blocks] (padded),
context_lens int32 [B]. Returns [B, Hq, D] in q's dtype.
"""
from __future__ import annotations

import math

import torch

from lab_utils.kernels import triton_env


def _jit():
    triton, why = triton_env.load()
    if triton is None:
        raise RuntimeError(why)
    from lab_utils.kernels import _decode_jit

    return triton, _decode_jit.paged_decode_kernel


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int) -> None:
    """Clear errors for shapes the kernel cannot take (it would read out of bounds silently)."""
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q must be [B, Hq, D] and k/v caches [num_slots, Hkv, D]; got q {tuple(q.shape)}, "
                         f"k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    if q.shape[1] % k_cache.shape[1] or q.shape[2] != k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k_cache.shape[1]} KV heads of dim "
                         f"{k_cache.shape[2]} (q's head dim {q.shape[2]})")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size}: the kernel needs a power of two (tl.arange)")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0] or context_lens.shape != (q.shape[0],):
        raise ValueError(f"block_tables must be [B={q.shape[0]}, max_blocks] and context_lens [B]; got "
                         f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}")


def _launch(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, num_splits):
    triton, kernel = _jit()
    check_inputs(q, k_cache, v_cache, block_tables, context_lens, block_size)
    B, Hq, D = q.shape
    max_blocks = block_tables.shape[1]
    per_split = max(1, -(-max_blocks // num_splits))
    splits = -(-max_blocks // per_split)
    q = q.contiguous()
    o = torch.empty(B, Hq, splits, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hq, splits, dtype=torch.float32, device=q.device)
    tables = block_tables.to(torch.int32).contiguous()
    ctx = context_lens.to(torch.int32).contiguous()
    kernel[(B, Hq, splits)](q, k_cache, v_cache, tables, ctx, o, lse,
                            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), tables.stride(0),
                            o.stride(0), o.stride(1), o.stride(2), float(scale), per_split,
                            GROUP=Hq // k_cache.shape[1], BLOCK=block_size, D=D,
                            BLOCK_D=triton.next_power_of_2(D))
    return o, lse


def combine_splits(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Split outputs o [B, Hq, S, D] (each normalised over its slice) and their log-sum-exps [B, Hq, S] -> the
    attention over the whole context: each slice weighted by exp(lse_s) / sum exp(lse)."""
    return (torch.softmax(lse, dim=-1).unsqueeze(-1) * o).sum(2)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """One program per (sequence, query head) over its whole context."""
    o, _ = _launch(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, 1)
    return o[:, :, 0].to(q.dtype)


def paged_decode_split(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, block_size: int, scale: float, num_splits: int) -> torch.Tensor:
    """`num_splits` programs per (sequence, query head), each over a slice of the blocks, combined by LSE."""
    o, lse = _launch(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, num_splits)
    return combine_splits(o, lse).to(q.dtype)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def tables_tensor(block_tables: list[list[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """Ragged block tables -> int32 [B, max_blocks], padded with block 0 (never read: past the context)."""
    width = max(len(t) for t in block_tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32, device=device)
