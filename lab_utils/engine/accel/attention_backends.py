"""The attention backends, by name: which attention callable serves a step, and which backend an engine runs.

An engine runs one attention backend, chosen once here (`select_attention_backend`, from
`EngineConfig.attention_backend`: "auto" or a name of `ATTENTION_BACKENDS`):
- "sdpa": `scaled_dot_product_attention` over the paged cache. A step goes to the first of these that takes it:
  "cpu_kernel" (decode-like rows through the compiled CPU kernel, `cpu_attention`; only while the runner has it
  on), "split" (on a CPU, decode rows in groups apart from prefill chunks, `split_attention`), then the plain
  `PagedAttention` the labs teach (`attention.py`);
- "flex": FlexAttention over the paged cache (`flex_attention`), the fast path on CUDA.
Every one computes the same attention; each implementation below returns None for a step it does not take.

A new backend is one entry in `ATTENTION_BACKENDS` (the one list of names: the config, the CLI and the
selection read it), its implementations in `IMPLEMENTATIONS`, and, if some machine or dtype cannot run it, a
rule in `CANNOT_RUN`.
"""
from __future__ import annotations

from typing import Callable

import torch

from lab_utils.engine.accel.cpu_attention import MAX_KERNEL_QUERIES, CpuDecodeAttention
from lab_utils.engine.accel.split_attention import SplitMetadata, SplitPagedAttention
from lab_utils.engine.attention import AttentionMetadata, PagedAttention
from lab_utils.engine.kv.kv_cache import KVCache
from lab_utils.models.llama import AttentionFn

# (cache, block tables, context lengths, query lengths, block size, device) -> the step's attention, or None
Implementation = Callable[[KVCache, list, list, list, int, torch.device], AttentionFn | None]


def cpu_kernel(cache: KVCache, tables: list[list[int]], ctx_lens: list[int], q_lens: list[int], block_size: int,
               device: torch.device) -> CpuDecodeAttention | None:
    """A step with a sequence of at most MAX_KERNEL_QUERIES new tokens (its other rows: `PagedAttention`)."""
    if min(q_lens) > MAX_KERNEL_QUERIES:
        return None
    return CpuDecodeAttention(cache, tables, ctx_lens, q_lens, block_size)


def split(cache: KVCache, tables: list[list[int]], ctx_lens: list[int], q_lens: list[int], block_size: int,
          device: torch.device) -> SplitPagedAttention | None:
    """A CPU step with something to split: decode rows in groups of 8 pay off on a CPU; on a GPU they multiply
    kernels and host syncs."""
    if device.type != "cpu":
        return None
    meta = SplitMetadata.build(tables, ctx_lens, q_lens, block_size, device)
    return None if meta is None else SplitPagedAttention(cache, meta)


def sdpa(cache: KVCache, tables: list[list[int]], ctx_lens: list[int], q_lens: list[int], block_size: int,
         device: torch.device) -> PagedAttention:
    """Any step: the reference paged attention."""
    return PagedAttention(cache, AttentionMetadata.build(tables, ctx_lens, q_lens, block_size, device))


def flex(cache: KVCache, tables: list[list[int]], ctx_lens: list[int], q_lens: list[int], block_size: int,
         device: torch.device) -> PagedAttention:
    """Any step: FlexAttention (imported on first use: it needs torch >= 2.5)."""
    from lab_utils.engine.accel.flex_attention import FlexPagedAttention

    return FlexPagedAttention(cache, AttentionMetadata.build(tables, ctx_lens, q_lens, block_size, device))


IMPLEMENTATIONS: dict[str, Implementation] = {"cpu_kernel": cpu_kernel, "split": split, "sdpa": sdpa, "flex": flex}
# each attention backend: the implementations a step tries, in order
ATTENTION_BACKENDS: dict[str, tuple[str, ...]] = {"sdpa": ("cpu_kernel", "split", "sdpa"), "flex": ("flex",)}
AUTO = "auto"  # the engine picks: `select_attention_backend`


def backend_names() -> tuple[str, ...]:
    """Every value `EngineConfig.attention_backend` accepts: "auto", then each backend's name."""
    return (AUTO, *ATTENTION_BACKENDS)


def _flex_cannot_run(device: torch.device, dtype: torch.dtype) -> str | None:
    from lab_utils.engine.accel.flex_attention import flex_available

    if not flex_available():
        return "FlexAttention needs torch >= 2.5 (torch.nn.attention.flex_attention)"
    if dtype == torch.float64:
        return "FlexAttention's kernel cannot compile for float64 (its template accumulates in float32)"
    return None


# backend -> why it cannot run on this device with this model dtype (None: it can); a backend absent runs anywhere
CANNOT_RUN: dict[str, Callable[[torch.device, torch.dtype], str | None]] = {"flex": _flex_cannot_run}


def select_attention_backend(requested: str, device: torch.device, dtype: torch.dtype,
                             enforce_eager: bool = False) -> str:
    """The backend an engine runs. "auto": "flex" on CUDA (compiled kernels) unless `enforce_eager` or flex
    cannot run this dtype there (float64), else "sdpa". A named backend is taken as asked, or refused with a
    ValueError saying why (it is never swapped for another behind the caller's back)."""
    if requested not in backend_names():
        raise ValueError(f"attention_backend={requested!r} is invalid: must be one of {backend_names()}")
    if requested == AUTO:
        flex_ok = device.type == "cuda" and not enforce_eager and _flex_cannot_run(device, dtype) is None
        return "flex" if flex_ok else "sdpa"
    why = CANNOT_RUN[requested](device, dtype) if requested in CANNOT_RUN else None
    if why:
        raise ValueError(f"attention_backend={requested!r} cannot run a {str(dtype).removeprefix('torch.')} model "
                         f"on {device.type}: {why}; use attention_backend='auto' (it picks one that can) or "
                         f"'sdpa'")
    return requested


def step_attention(backend: str, cache: KVCache, tables: list[list[int]], ctx_lens: list[int], q_lens: list[int],
                   block_size: int, device: torch.device, off: tuple[str, ...] = ()) -> AttentionFn:
    """The attention callable of one step under `backend`: the first of its implementations (less those in `off`)
    that takes the step."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r} is invalid: must be one of {tuple(ATTENTION_BACKENDS)} "
                         f"(select_attention_backend resolves 'auto')")
    for name in ATTENTION_BACKENDS[backend]:
        if name in off:
            continue
        attention = IMPLEMENTATIONS[name](cache, tables, ctx_lens, q_lens, block_size, device)
        if attention is not None:
            return attention
    raise AssertionError(f"unreachable: attention backend {backend!r} ends with an implementation for any step")
