"""A decode kernel as the engine's attention: the "triton" implementation of a step, and an engine that runs a
given kernel (the learner's `kernel.paged_decode`, or the reference) for its decode steps.

A decode-only step (one new token per sequence) goes to the kernel: the new K/V are written to the cache, then
the kernel reads every sequence's context through its block table in place. Any other step (prefill, chunks)
and a quantized cache go to the engine's own attention.
"""
from __future__ import annotations

from typing import Callable

import torch

from lab_utils.engine.accel.fast_paths import FastPaths
from lab_utils.engine.attention import slot_mapping
from lab_utils.kernels.paged_decode_triton import default_scale, tables_tensor

Kernel = Callable  # (q, k_cache, v_cache, block_tables, context_lens, block_size, scale) -> [B, Hq, D]


class KernelDecodeAttention:
    """The `attention(layer_idx, q, k, v)` callable of one decode step, through `kernel`."""

    def __init__(self, cache, tables: list[list[int]], ctx_lens: list[int], block_size: int, device: torch.device,
                 kernel: Kernel) -> None:
        self.cache, self.block_size, self.kernel = cache, block_size, kernel
        self.slots = torch.tensor(slot_mapping(tables, ctx_lens, [1] * len(ctx_lens), block_size), device=device)
        self.tables = tables_tensor(tables, device)
        self.ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
        self.calls = 0

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q[0], k[0], v[0]  # one flat batch of N = B decode tokens: [N, H, D]
        self.cache.write(layer_idx, self.slots, k, v)
        out = self.kernel(q, self.cache.k[layer_idx], self.cache.v[layer_idx], self.tables, self.ctx,
                          self.block_size, default_scale(q.shape[-1]))
        if not isinstance(out, torch.Tensor) or out.shape != q.shape:
            raise ValueError(f"the decode kernel returned {getattr(out, 'shape', type(out).__name__)}; the engine "
                             f"needs [B, Hq, D] = {tuple(q.shape)}")
        return out[None]


def takes(cache, q_lens: list[int]) -> bool:
    """A decode-only step over a cache stored in the compute dtype (an fp8/int8 cache needs dequantising)."""
    return max(q_lens) == 1 and cache.store_dtype == cache.compute_dtype


def triton(cache, tables: list[list[int]], ctx_lens: list[int], q_lens: list[int], block_size: int,
           device: torch.device, kernel: Kernel | None = None) -> KernelDecodeAttention | None:
    """The "triton" implementation: the reference Triton kernel (or `kernel`) for a decode-only step, else None."""
    if not takes(cache, q_lens):
        return None
    if kernel is None:
        from lab_utils.kernels.paged_decode_triton import paged_decode as kernel
    return KernelDecodeAttention(cache, tables, ctx_lens, block_size, device, kernel)


class KernelFastPaths(FastPaths):
    """The engine's attention with decode steps through `kernel`; counts the steps it took. No fallback: an
    error in the kernel reaches the caller (a learner's bug must not be hidden by the engine's own path)."""

    def __init__(self, kernel: Kernel) -> None:
        super().__init__("sdpa", None, cpu_kernel=False)
        self.kernel, self.kernel_steps = kernel, 0

    def attention(self, cache, tables, ctx_lens, q_lens, block_size, device):
        attention = triton(cache, tables, ctx_lens, q_lens, block_size, device, self.kernel)
        if attention is None:
            return super().attention(cache, tables, ctx_lens, q_lens, block_size, device)
        self.kernel_steps += 1
        return attention


def run_kernel_in(engine, kernel: Kernel | None = None) -> KernelFastPaths:
    """Make `engine` run `kernel` for its decode steps: by default the engine's part `kernel.paged_decode`
    (the learner's where `parts=` has it, else the reference Triton kernel). Returns its fast paths."""
    if kernel is None:
        from lab_utils.kernels.paged_decode_triton import paged_decode

        kernel = engine.parts.function("kernel.paged_decode", paged_decode)
    paths = KernelFastPaths(kernel)
    engine.runner.fast_paths = paths
    return paths
