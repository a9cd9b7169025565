"""Paged decode attention as one compiled CPU kernel a layer (issue #13).

On a CPU, `PagedAttention` costs a decode step ~8 small kernels a layer for each group of rows: write the new
K/V, gather every sequence's keys and values into a padded copy, transpose, `scaled_dot_product_attention` with a
mask, scatter the output back. At batch 1-16 the arithmetic is a few thousand multiply-adds a layer, so nearly
all of that time is dispatch and memory passes. `csrc/paged_decode_attention.cpp` does the same maths in one
call a layer: it walks each sequence's block table and reads its K/V where they lie (the idea of vLLM's CPU
`paged_attention_v1`, in ~60 lines of plain C++).

The kernel is compiled on first use with `torch.utils.cpp_extension` (g++ and ninja; ~1 minute once, then cached
under `cache_dir()/torch_extensions`). Where it cannot be built (no compiler) the engine says why once and keeps
the PyTorch path, which stays the one the labs teach: `cpu_kernel_status()` tells which is in use, and
`LAB_CPU_ATTENTION_KERNEL=0` turns the kernel off (A/B measurements). Only float32 caches on a CPU use it;
prefill chunks and speculative verify rows (several queries a sequence) keep `PagedAttention`.
"""
from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # Windows: no file locks, builds are not shared between processes there anyway
    fcntl = None

from lab_utils.engine.attention import AttentionMetadata, PagedAttention
from lab_utils.engine.kv_cache import KVCache
from lab_utils.paths import cache_dir

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"
_state: dict[str, object] = {}


# -fopenmp: ATen's parallel_for is OpenMP code inlined from its header; the extension then shares torch's own
# libgomp (same soname, already loaded). -ffast-math lets the softmax's exp vectorise.
_ISA = {"AVX2": ["-mavx2", "-mfma"], "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"]}


def _flags() -> list[str]:
    return ["-O3", "-ffast-math", "-fopenmp", *_ISA.get(torch.backends.cpu.get_cpu_capability(), [])]


def _build_dir() -> Path:
    """One folder per source, flags, torch version and CPU capability: a changed kernel or another CPU rebuilds."""
    capability = torch.backends.cpu.get_cpu_capability()  # e.g. AVX2, AVX512, DEFAULT
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(_flags()).encode() + torch.__version__.encode()).hexdigest()
    return cache_dir() / "torch_extensions" / f"paged_decode_attention-{capability.lower()}-{key[:12]}"


def _compile():
    from torch.utils.cpp_extension import load

    build = _build_dir()
    build.mkdir(parents=True, exist_ok=True)
    with open(build / "build.lock", "w") as lock:
        if fcntl is not None:  # two processes building at once (a lab and a test) would corrupt the build
            fcntl.flock(lock, fcntl.LOCK_EX)
        return load(name="lab_paged_decode_attention", sources=[str(SOURCE)], build_directory=str(build),
                    extra_cflags=_flags(), extra_ldflags=["-fopenmp"], verbose=False)


def cpu_kernel() -> object | None:
    """The compiled kernel module, or None (switched off, or it could not be built: `cpu_kernel_status()` says
    why). Built once per process, on first call."""
    if os.environ.get("LAB_CPU_ATTENTION_KERNEL", "1") == "0":
        return None
    if "module" not in _state:
        try:
            _state["module"], _state["status"] = _compile(), "compiled CPU kernel (csrc/paged_decode_attention.cpp)"
        except Exception as err:  # no compiler, no headers, a build error: the PyTorch path still works
            _state["module"] = None
            _state["status"] = f"PyTorch path: the CPU attention kernel could not be built ({type(err).__name__}: " \
                               f"{str(err).strip().splitlines()[-1] if str(err).strip() else ''})"
            warnings.warn(_state["status"] + "; decode attention stays on PyTorch ops (slower, same results)")
    return _state["module"]


def cpu_kernel_status() -> str:
    """Which decode attention a CPU float32 engine uses, and why."""
    if os.environ.get("LAB_CPU_ATTENTION_KERNEL", "1") == "0":
        return "PyTorch path: LAB_CPU_ATTENTION_KERNEL=0"
    cpu_kernel()
    return str(_state["status"])


def kernel_usable(cache: KVCache, device: torch.device) -> bool:
    """A float32 cache (stored as computed) on a CPU, and the kernel built."""
    return (device.type == "cpu" and cache.store_dtype == torch.float32 and cache.compute_dtype == torch.float32
            and cpu_kernel() is not None)


class CpuDecodeAttention:
    """The step's `attention` callable when it has decode rows: those go through the kernel (after their K/V
    are written), the other sequences' rows (prefill chunks, verify rows) through `PagedAttention`."""

    def __init__(self, cache: KVCache, block_tables: list[list[int]], context_lens: list[int],
                 query_lens: list[int], block_size: int) -> None:
        self.cache, self.block_size, self.kernel = cache, block_size, cpu_kernel()
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
