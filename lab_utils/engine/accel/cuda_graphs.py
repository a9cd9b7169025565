"""CUDA graphs for decode steps: record a step's ~30 x 15 kernel launches once, replay them with one call.

A decode step of a small model on a GPU is launch-bound: the kernels are tiny and the CPU cannot issue them as
fast as the GPU runs them. A CUDA graph records the launches of one forward pass into *static* input and
output buffers; a replay re-issues them all at once. Shapes are frozen at capture, so (as in vLLM):
- a graph is captured per batch-size bucket (1, 2, 4, 8, 16, 32, ...) and per context-length bucket (powers
  of two from 256), lazily, the first time a step of that size comes;
- a step of n sequences is padded up to its bucket with copies of its first row (same token, position and
  slots, so a copy writes the very K/V the original writes: no real cache entry changes), and the keys it
  reads are padded to the context bucket with masked-out slots;
- only decode-only steps replay a graph; prefill steps (and steps bigger than the largest bucket) run eagerly.

Off when `enforce_eager=True` or not on CUDA. With `capture=False` the runner runs the same padded,
static-buffer forward without a graph: that is how the padding logic is tested on a CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lab_utils.engine.attention import AttentionMetadata, PagedAttention
from lab_utils.engine.kv.kv_cache import KVCache

MIN_CONTEXT_BUCKET = 256


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two from 1 up to the first one that holds `max_num_seqs`."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs} is invalid: must be >= 1")
    out, b = [], 1
    while True:
        out.append(b)
        if b >= max_num_seqs:
            return tuple(out)
        b *= 2


def bucket_for(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds n rows; None if n is larger than every bucket (run eagerly)."""
    if n < 1:
        raise ValueError(f"a decode step needs at least one row, got n={n}")
    return next((b for b in buckets if b >= n), None)


def context_bucket(max_context: int, block_size: int, max_model_len: int) -> int:
    """Keys read per row: a power of two >= max_context (at least MIN_CONTEXT_BUCKET), capped at the longest
    sequence the engine allows (rounded up to whole blocks)."""
    if max_context < 1:
        raise ValueError(f"max_context={max_context} is invalid: must be >= 1")
    cap = -(-max_model_len // block_size) * block_size
    b = MIN_CONTEXT_BUCKET
    while b < max_context:
        b *= 2
    return max(min(b, cap), max_context)


def pad_decode_batch(ids: list[int], pos: list[int], ctx_lens: list[int], tables: list[list[int]],
                     size: int) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """Pad a decode step to `size` rows with copies of row 0 (see the module docstring for why copies)."""
    n = len(ids)
    if not 1 <= n <= size:
        raise ValueError(f"cannot pad a decode step of {n} rows to {size} rows")
    k = size - n
    return ids + [ids[0]] * k, pos + [pos[0]] * k, ctx_lens + [ctx_lens[0]] * k, tables + [tables[0]] * k


def padded_metadata(tables: list[list[int]], ctx_lens: list[int], block_size: int, context_len: int,
                    device: torch.device) -> AttentionMetadata:
    """Decode metadata whose key axis is exactly `context_len` long (extra keys: slot 0, masked out)."""
    meta = AttentionMetadata.build(tables, ctx_lens, [1] * len(ctx_lens), block_size, device)
    extra = context_len - meta.context_slots.shape[1]
    if extra < 0:
        raise ValueError(f"context_len={context_len} is shorter than the longest context {max(ctx_lens)}")
    if extra:
        meta.context_slots = torch.nn.functional.pad(meta.context_slots, (0, extra), value=0)
        meta.mask = torch.nn.functional.pad(meta.mask, (0, extra), value=False)
    return meta


@dataclass
class _Entry:
    """Static buffers of one (batch, context) bucket, and its graph once captured."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    hidden: torch.Tensor | None = None
    graph: object | None = None


class DecodeGraphRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache, block_size: int, device: torch.device,
                 max_num_seqs: int, max_model_len: int, capture: bool | None = None) -> None:
        self.model, self.cache, self.block_size, self.device = model, cache, block_size, device
        self.buckets = batch_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self.capture = device.type == "cuda" if capture is None else capture
        if self.capture and device.type != "cuda":
            raise ValueError(f"CUDA graph capture needs a CUDA device, got {device}")
        self.entries: dict[tuple[int, int], _Entry] = {}
        self.pool = None
        self.num_replays = 0

    def can_run(self, n: int) -> bool:
        return bucket_for(n, self.buckets) is not None

    def _entry(self, b: int, L: int) -> _Entry:
        e = self.entries.get((b, L))
        if e is None:
            z = torch.zeros(1, b, dtype=torch.long, device=self.device)
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(b, dtype=torch.long, device=self.device),
                context_slots=torch.zeros(b, L, dtype=torch.long, device=self.device),
                query_index=torch.zeros(b, 1, dtype=torch.long, device=self.device),
                unpad_index=torch.arange(b, device=self.device),
                mask=torch.zeros(b, 1, 1, L, dtype=torch.bool, device=self.device),
                decode_only=True,
            )
            e = self.entries[(b, L)] = _Entry(z, z.clone(), meta)
        return e

    def _forward(self, e: _Entry) -> torch.Tensor:
        return self.model.hidden_states(e.input_ids, e.positions, attention=PagedAttention(self.cache, e.meta))

    @torch.inference_mode()
    def run(self, ids: list[int], pos: list[int], ctx_lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One decode step of n rows -> hidden states [n, H] (padded to a bucket, replayed if captured)."""
        n = len(ids)
        b = bucket_for(n, self.buckets)
        if b is None:
            raise ValueError(f"decode step of {n} rows is larger than the largest graph bucket {self.buckets[-1]}")
        L = context_bucket(max(ctx_lens), self.block_size, self.max_model_len)
        ids, pos, ctx_lens, tables = pad_decode_batch(ids, pos, ctx_lens, tables, b)
        meta = padded_metadata(tables, ctx_lens, self.block_size, L, self.device)
        e = self._entry(b, L)
        e.input_ids.copy_(torch.tensor(ids, dtype=torch.long)[None])
        e.positions.copy_(torch.tensor(pos, dtype=torch.long)[None])
        for name in ("slot_mapping", "context_slots", "mask"):
            getattr(e.meta, name).copy_(getattr(meta, name))
        if not self.capture:
            return self._forward(e)[0, :n]
        if e.graph is None:
            self._capture(e)  # the buffers already hold this step: warm-up writes the step's own K/V
        e.graph.replay()
        self.num_replays += 1
        return e.hidden[0, :n]

    def _capture(self, e: _Entry) -> None:
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: lazy initialisation must not happen inside the capture
                self._forward(e)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            e.hidden = self._forward(e)
        self.pool = graph.pool()
        e.graph = graph


def runner_options(config, device: torch.device, model: torch.nn.Module, cache: KVCache, block_size: int,
                   max_model_len: int) -> dict:
    """The CUDA fast paths an engine's runner gets (`fast_paths.FastPaths.for_engine`): the attention backend
    `config.attention_backend` resolves to (`attention_backends.select_attention_backend`: flex on CUDA for
    "auto") and decode CUDA graphs on CUDA, none with enforce_eager."""
    from lab_utils.engine.accel.attention_backends import select_attention_backend

    backend = select_attention_backend(config.attention_backend, device, model.dtype, config.enforce_eager)
    graphs = None
    if device.type == "cuda" and not config.enforce_eager:
        graphs = DecodeGraphRunner(model, cache, block_size, device, config.max_num_seqs, max_model_len)
    return {"attention_backend": backend, "graphs": graphs}
