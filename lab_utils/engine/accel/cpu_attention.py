"""Paged decode attention as one compiled CPU kernel a layer.

On a CPU, `PagedAttention` costs a decode step ~8 small kernels a layer for each group of rows: write the new
K/V, gather every sequence's keys and values into a padded copy, transpose, `scaled_dot_product_attention` with a
mask, scatter the output back. At batch 1-16 the arithmetic is a few thousand multiply-adds a layer, so nearly
all of that time is dispatch and memory passes. `csrc/paged_decode_attention.cpp` does the same maths in one
call a layer: it walks each sequence's block table and reads its K/V where they lie (the idea of vLLM's CPU
`paged_attention_v1`, in ~60 lines of plain C++).

`cpu_kernels` builds it (or says why it could not; the engine then keeps `PagedAttention`, which stays the
path the labs teach); `EngineConfig.cpu_kernels=False` (`LAB_CPU_KERNELS=0`) turns it off. Only float32 caches
on a CPU use it. Decode rows and speculative verify rows (a few queries a sequence, each its own kernel row) go
through it; long prefill chunks keep `PagedAttention`. It is the "cpu_kernel" attention backend
(`attention_backends`).
"""
from __future__ import annotations

import torch

from lab_utils.engine.attention import AttentionMetadata, PagedAttention
from lab_utils.engine.accel.cpu_kernels import cpu_kernels
from lab_utils.engine.kv.kv_cache import KVCache
from lab_utils.engine.kv.paging import slot


def kernel_usable(cache: KVCache, device: torch.device, enabled: bool | None = None) -> bool:
    """A float32 cache (stored as computed) on a CPU, and the kernel switched on (`enabled`: an engine's
    `cpu_kernels`, None for the config's default) and built."""
    return (device.type == "cpu" and cache.store_dtype == torch.float32 and cache.compute_dtype == torch.float32
            and cpu_kernels(enabled) is not None)


# Sequences with at most this many new tokens in a step go through the kernel, one row a query (decode rows, and
# the k + 1 rows of a speculative verify); longer prefill chunks keep SDPA, whose blocked GEMMs win there.
MAX_KERNEL_QUERIES = 16


class CpuDecodeAttention:
    """The step's `attention` callable when it has decode-like rows. A sequence with n <= MAX_KERNEL_QUERIES new
    tokens becomes n kernel rows: query j sits at position p = context - n + j and reads tokens 0..p through the
    sequence's block table (its own causal mask). Their K/V are written first, then one kernel call serves them
    all; prefill chunks go through `PagedAttention`."""

    def __init__(self, cache: KVCache, block_tables: list[list[int]], context_lens: list[int],
                 query_lens: list[int], block_size: int) -> None:
        self.cache, self.block_size, self.kernel = cache, block_size, cpu_kernels(True)  # chosen: switched on
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        short = [i for i, n in enumerate(query_lens) if n <= MAX_KERNEL_QUERIES]
        others = [i for i, n in enumerate(query_lens) if n > MAX_KERNEL_QUERIES]
        if not short:
            raise ValueError(f"CpuDecodeAttention needs a sequence with at most {MAX_KERNEL_QUERIES} new tokens")
        rows, tables, lens, slots = [], [], [], []
        for i in short:
            table, ctx, n = block_tables[i], context_lens[i], query_lens[i]
            for j in range(n):
                pos = ctx - n + j
                rows.append(starts[i] + j)
                tables.append(table)
                lens.append(pos + 1)
                slots.append(slot(table, pos, block_size))
        width = max(len(t) for t in tables)
        self.tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        self.lens = torch.tensor(lens, dtype=torch.int32)
        self.slots = torch.tensor(slots, dtype=torch.long)
        # flat token index of each kernel row; None when every row of the step is one (the common case)
        self.rows = None if not others else torch.tensor(rows, dtype=torch.long)
        self.other = None
        if others:
            meta = AttentionMetadata.build([block_tables[i] for i in others], [context_lens[i] for i in others],
                                           [query_lens[i] for i in others], block_size, torch.device("cpu"))
            other_rows = [r for i in others for r in range(starts[i], starts[i + 1])]
            self.other = (torch.tensor(other_rows, dtype=torch.long), PagedAttention(cache, meta))

    def decode(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [R, Hq, D], k/v [R, Hkv, D] for the R kernel rows -> attention output [R, Hq, D]."""
        self.cache.write(layer_idx, self.slots, k, v)  # all of them before any row reads its context
        return self.kernel.paged_decode_attention(q, self.cache.k[layer_idx], self.cache.v[layer_idx], self.tables,
                                                  self.lens, self.block_size, q.shape[-1] ** -0.5)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.other is None:  # [1, N, H, D], every row a kernel row
            return self.decode(layer_idx, q[0], k[0], v[0])[None]
        out = torch.empty_like(q)
        out[0, self.rows] = self.decode(layer_idx, q[0, self.rows], k[0, self.rows], v[0, self.rows])
        rows, attn = self.other
        out[:, rows] = attn(layer_idx, q[:, rows], k[:, rows], v[:, rows])
        return out
