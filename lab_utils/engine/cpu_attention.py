"""Paged decode attention as one compiled CPU kernel a layer (issue #13).

On a CPU, `PagedAttention` costs a decode step ~8 small kernels a layer for each group of rows: write the new
K/V, gather every sequence's keys and values into a padded copy, transpose, `scaled_dot_product_attention` with a
mask, scatter the output back. At batch 1-16 the arithmetic is a few thousand multiply-adds a layer, so nearly
all of that time is dispatch and memory passes. `csrc/paged_decode_attention.cpp` does the same maths in one
call a layer: it walks each sequence's block table and reads its K/V where they lie (the idea of vLLM's CPU
`paged_attention_v1`, in ~60 lines of plain C++).

`cpu_kernels` builds it (or says why it could not; the engine then keeps `PagedAttention`, which stays the
path the labs teach); `LAB_CPU_KERNELS=0` turns it off. Only float32 caches on a CPU use it; prefill chunks
and speculative verify rows (several queries a sequence) keep `PagedAttention`.
"""
from __future__ import annotations

import torch

from lab_utils.engine.attention import AttentionMetadata, PagedAttention
from lab_utils.engine.cpu_kernels import cpu_kernels
from lab_utils.engine.kv_cache import KVCache


def kernel_usable(cache: KVCache, device: torch.device) -> bool:
    """A float32 cache (stored as computed) on a CPU, and the kernel built."""
    return (device.type == "cpu" and cache.store_dtype == torch.float32 and cache.compute_dtype == torch.float32
            and cpu_kernels() is not None)


class CpuDecodeAttention:
    """The step's `attention` callable when it has decode rows: those go through the kernel (after their K/V
    are written), the other sequences' rows (prefill chunks, verify rows) through `PagedAttention`."""

    def __init__(self, cache: KVCache, block_tables: list[list[int]], context_lens: list[int],
                 query_lens: list[int], block_size: int) -> None:
        self.cache, self.block_size, self.kernel = cache, block_size, cpu_kernels()
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        decodes = [i for i, n in enumerate(query_lens) if n == 1]
        others = [i for i, n in enumerate(query_lens) if n != 1]
        if not decodes:
            raise ValueError("CpuDecodeAttention needs at least one decode row (query length 1)")
        width = max(len(block_tables[i]) for i in decodes)
        self.tables = torch.tensor([block_tables[i] + [0] * (width - len(block_tables[i])) for i in decodes],
                                   dtype=torch.int32)
        self.lens = torch.tensor([context_lens[i] for i in decodes], dtype=torch.int32)
        self.slots = torch.tensor([block_tables[i][(context_lens[i] - 1) // block_size] * block_size
                                   + (context_lens[i] - 1) % block_size for i in decodes], dtype=torch.long)
        # flat token index of each decode row; None when the step is decode rows only (the common case)
        self.rows = None if not others else torch.tensor([starts[i] for i in decodes], dtype=torch.long)
        self.other = None
        if others:
            meta = AttentionMetadata.build([block_tables[i] for i in others], [context_lens[i] for i in others],
                                           [query_lens[i] for i in others], block_size, torch.device("cpu"))
            rows = torch.tensor([r for i in others for r in range(starts[i], starts[i + 1])], dtype=torch.long)
            self.other = (rows, PagedAttention(cache, meta))

    def decode(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [R, Hq, D], k/v [R, Hkv, D]: one new token per decode row -> attention output [R, Hq, D]."""
        self.cache.write(layer_idx, self.slots, k, v)
        return self.kernel.paged_decode_attention(q, self.cache.k[layer_idx], self.cache.v[layer_idx], self.tables,
                                                  self.lens, self.block_size, q.shape[-1] ** -0.5)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.other is None:  # [1, N, H, D] with N decode rows
            return self.decode(layer_idx, q[0], k[0], v[0])[None]
        out = torch.empty_like(q)
        out[0, self.rows] = self.decode(layer_idx, q[0, self.rows], k[0, self.rows], v[0, self.rows])
        rows, attn = self.other
        out[:, rows] = attn(layer_idx, q[:, rows], k[:, rows], v[:, rows])
        return out
