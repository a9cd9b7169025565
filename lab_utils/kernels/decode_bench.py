"""Decode attention against its bound: the bytes and FLOPs of one decode step's attention, this machine's read
bandwidth and matmul peak, and microseconds per call of an attention path, as a fraction of the time that
reading the KV bytes takes at the measured bandwidth.

One decode step reads every cached key and value of every sequence once and does two multiply-adds per element
of them per query head sharing it (q.k and p.v): 4 FLOPs per (position, query head, dim) against 2 x bytes per
element per (position, KV head, dim). At a few bytes per FLOP it sits far left of any machine's ridge: the bound
is the time to read the bytes.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from lab_utils.kernels.decode_cases import DecodeCase
from lab_utils.kernels.paged_decode_triton import default_scale, tables_tensor


@dataclass(frozen=True)
class DecodeShape:
    """One grid point: `batch` sequences of `context` cached tokens each, one new query token per sequence."""
    batch: int
    context: int
    q_heads: int = 9  # SmolLM2-135M: 9 query heads on 3 KV heads of dim 64
    kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.batch < 1 or self.context < 1:
            raise ValueError(f"batch={self.batch}, context={self.context}: both must be >= 1")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"{self.q_heads} query heads cannot share {self.kv_heads} KV heads evenly")
        if not hasattr(torch, self.dtype) or not isinstance(getattr(torch, self.dtype), torch.dtype):
            raise ValueError(f"dtype {self.dtype!r} is not a torch dtype name (float32, bfloat16, float16)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def elem_bytes(self) -> int:
        return torch.empty(0, dtype=self.torch_dtype).element_size()

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V one call reads (queries and outputs are ~1/context of that)."""
        return 2 * self.batch * self.context * self.kv_heads * self.head_dim * self.elem_bytes

    @property
    def flops(self) -> int:
        return 4 * self.batch * self.context * self.q_heads * self.head_dim

    @property
    def bytes_per_flop(self) -> float:
        return self.kv_bytes / self.flops

    def as_dict(self) -> dict:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_us(fn: Callable[[], object], device: torch.device, repeats: int = 5, warmup: int = 1) -> float:
    """Median microseconds of `fn()` over `repeats` calls after `warmup` (the device synchronised around each)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def fastest_s(fn: Callable[[], object], device: torch.device, min_repeats: int = 10,
              min_seconds: float = 0.05) -> float:
    """Seconds of the fastest of many calls of `fn` (at least `min_repeats`, for at least `min_seconds`): what the
    machine can do, not what a busy moment let it do. On a CPU with all of PyTorch's threads and with one (a
    thread pool on a busy machine waits for its slowest thread), the faster of the two."""
    threads = torch.get_num_threads()
    best = float("inf")
    for n_threads in ([threads, 1] if device.type == "cpu" and threads > 1 else [threads]):
        torch.set_num_threads(n_threads)
        try:
            fn()
            _sync(device)
            n, start = 0, time.perf_counter()
            while n < min_repeats or time.perf_counter() - start < min_seconds:
                t0 = time.perf_counter()
                fn()
                _sync(device)
                best, n = min(best, time.perf_counter() - t0), n + 1
        finally:
            torch.set_num_threads(threads)
    return best


def read_bandwidth(nbytes: int, device: torch.device) -> float:
    """Bytes/s of reading a tensor of `nbytes` (a reduction over it, the fastest run). Measured at the size being
    judged, so a small grid point's bound is its cache's, not main memory's."""
    x = torch.rand(max(1024, nbytes // 4), device=device)
    return x.nbytes / fastest_s(x.sum, device)


def peak_flops(device: torch.device, n: int = 512, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of the fastest n x n matmul: the compute roof of this machine at that dtype."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / fastest_s(lambda: a @ b, device, min_repeats=5, min_seconds=0.2)


def paged_case(shape: DecodeShape, device: torch.device | str, seed: int = 0) -> DecodeCase:
    """Random queries and a paged cache holding `context` tokens per sequence, its blocks shuffled in the pool."""
    rng = random.Random(seed)
    bs = shape.block_size
    per_seq = -(-shape.context // bs)
    ids = list(range(shape.batch * per_seq))
    rng.shuffle(ids)
    tables = [ids[i * per_seq:(i + 1) * per_seq] for i in range(shape.batch)]
    g = torch.Generator().manual_seed(seed)
    dt = shape.torch_dtype
    k = torch.randn(len(ids) * bs, shape.kv_heads, shape.head_dim, generator=g).to(device, dt)
    v = torch.randn(len(ids) * bs, shape.kv_heads, shape.head_dim, generator=g).to(device, dt)
    q = torch.randn(shape.batch, shape.q_heads, shape.head_dim, generator=g).to(device, dt)
    return DecodeCase(q, k, v, tables, [shape.context] * shape.batch, bs)


def kernel_call(kernel: Callable, case: DecodeCase, num_splits: int | None = None) -> Callable[[], torch.Tensor]:
    """A no-argument call of a decode kernel (the lab's launcher signature) on `case`, tensors built once."""
    args = (case.q, case.k_cache, case.v_cache, tables_tensor(case.tables, case.q.device),
            torch.tensor(case.context_lens, dtype=torch.int32, device=case.q.device), case.block_size, case.scale)
    if num_splits is None:
        return lambda: kernel(*args)
    return lambda: kernel(*args, num_splits)


def engine_call(case: DecodeCase, backend: str) -> Callable[[], torch.Tensor]:
    """The engine's own attention for this decode step (`step_attention` under `backend`: its CPU kernel or
    paged SDPA on a CPU, FlexAttention on CUDA), one layer: the new token's K/V written, then attention."""
    from lab_utils.engine.accel.attention_backends import step_attention
    from lab_utils.engine.kv.kv_cache import KVCache

    B, _, D = case.q.shape
    Hkv, bs = case.k_cache.shape[1], case.block_size
    cache = KVCache(1, case.k_cache.shape[0] // bs, bs, Hkv, D, case.q.dtype, case.q.dtype, case.q.device)
    cache.k[0].copy_(case.k_cache)
    cache.v[0].copy_(case.v_cache)
    attention = step_attention(backend, cache, case.tables, case.context_lens, [1] * B, bs, case.q.device)
    last = torch.tensor([t[(c - 1) // bs] * bs + (c - 1) % bs for t, c in zip(case.tables, case.context_lens)],
                        device=case.q.device)
    q, k_new, v_new = case.q[None], case.k_cache[last][None], case.v_cache[last][None]  # rewrites what is there
    return lambda: attention(0, q, k_new, v_new)


def dense_copy(case: DecodeCase) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V gathered once into dense [B, Hkv, context, D] (every sequence of equal length)."""
    bs = case.block_size
    slots = torch.tensor([[blk * bs + o for blk in t for o in range(bs)][:c]
                          for t, c in zip(case.tables, case.context_lens)], device=case.q.device)
    return case.k_cache[slots].transpose(1, 2).contiguous(), case.v_cache[slots].transpose(1, 2).contiguous()


def sdpa_dense_call(case: DecodeCase) -> Callable[[], torch.Tensor]:
    """PyTorch's SDPA over a dense copy made beforehand (the copy not timed): attention with no paging at all."""
    k, v = dense_copy(case)
    q = case.q[:, :, None]
    scale = default_scale(case.q.shape[-1])
    return lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)


@dataclass
class Timing:
    path: str
    shape: DecodeShape
    us: float
    bound_us: float

    @property
    def fraction(self) -> float:
        """Of the KV-bytes bound: 1.0 would be reading the bytes at the measured bandwidth and nothing else."""
        return self.bound_us / self.us


def measure(paths: dict[str, Callable[[DecodeCase], Callable[[], torch.Tensor]]], shape: DecodeShape,
            device: torch.device, repeats: int = 3, seed: int = 0) -> list[Timing]:
    """Each path's median µs per call on one random paged case of `shape`, with the bound: the case's KV bytes
    at the read bandwidth measured on a tensor of that size."""
    case = paged_case(shape, device, seed)
    bound_us = 1e6 * shape.kv_bytes / read_bandwidth(shape.kv_bytes, device)
    return [Timing(name, shape, time_us(make(case), device, repeats), bound_us) for name, make in paths.items()]
