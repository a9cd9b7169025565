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

import numpy as np
import torch
import torch.nn.functional as F

from lab_utils.engine.attention import AttentionMetadata, PagedAttention, padded_tables
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
    """Static buffers of one (batch, context) bucket, and its graph once captured.

    `inputs` is the one buffer a step copies in: token ids [b], positions [b] and block tables [b, nblk], int64
    side by side (`input_ids`, `positions`, `tables` are views of it). The attention metadata (slots, mask) is
    computed from it inside the captured forward, so a replay recomputes it on the device."""

    inputs: torch.Tensor
    keys: torch.Tensor  # [L] key positions 0..L-1
    key_block: torch.Tensor  # [L] logical block of each key position
    key_offset: torch.Tensor  # [L] its offset in the block
    query_index: torch.Tensor  # [b, 1] zeros (decode: one query per row)
    unpad_index: torch.Tensor  # [b]
    hidden: torch.Tensor | None = None
    graph: object | None = None

    @property
    def batch(self) -> int:
        return self.unpad_index.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        return self.inputs[:self.batch].view(1, -1)

    @property
    def positions(self) -> torch.Tensor:
        return self.inputs[self.batch:2 * self.batch].view(1, -1)

    @property
    def tables(self) -> torch.Tensor:
        return self.inputs[2 * self.batch:].view(self.batch, -1)


def decode_metadata(e: _Entry, block_size: int) -> AttentionMetadata:
    """A decode step's attention metadata from an entry's static buffers, on the device: the key slots of every
    row [b, L], the slot of each new token, the mask of keys 0..position."""
    pos = e.positions[0]
    context_slots = e.tables.index_select(1, e.key_block) * block_size + e.key_offset
    slot_mapping = context_slots.gather(1, pos[:, None]).view(-1)
    mask = (e.keys[None, :] <= pos[:, None]).view(e.batch, 1, 1, -1)
    return AttentionMetadata(slot_mapping=slot_mapping, context_slots=context_slots, query_index=e.query_index,
                             unpad_index=e.unpad_index, mask=mask, decode_only=True)


class StaticDecodeAttention(PagedAttention):
    """`PagedAttention` over an entry's static buffers: its metadata is computed on the device (`decode_metadata`)
    inside the forward a graph records, once per step (`prepare`, or the first layer that attends).

    Over a cache that stores the compute dtype it `takes_token_major`: a model that sets `token_major` hands it
    q/k/v as [N, H, 1, D] (each decode row its own SDPA batch entry) and it writes and reads the cache through per-layer views, one call each
    for the K and V writes, the K and V gathers (straight into SDPA's [N, Hkv, L, D]) and SDPA; it returns
    [N, Hq, 1, D] (the memory of [1, N, Hq, D]). Quantized and fp8 caches take `PagedAttention`'s path."""

    def __init__(self, cache: KVCache, entry: _Entry, block_size: int, views: CacheViews | None = None) -> None:
        self.cache, self.entry, self.block_size, self._meta = cache, entry, block_size, None
        self.views = views  # None: the generic path
        self.takes_token_major = views is not None  # a model that passes [N, H, 1, D] sets `token_major`
        self.token_major = False

    def prepare(self) -> None:
        if self._meta is None:
            m = self._meta = decode_metadata(self.entry, self.block_size)
            if self.views is not None:  # index [N, 1, L] x [1, Hkv, 1] -> keys [N, Hkv, L, D]
                self._gather = (m.context_slots[:, None, :], self.views.heads)

    @property
    def meta(self) -> AttentionMetadata:
        self.prepare()
        return self._meta

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self.token_major:
            return super().__call__(layer_idx, q, k, v)
        self.prepare()
        k_in, v_in, k_out, v_out = self.views.layers[layer_idx]
        k_in.index_copy_(0, self._meta.slot_mapping, k)
        v_in.index_copy_(0, self._meta.slot_mapping, v)
        return F.scaled_dot_product_attention(q, k_out[self._gather], v_out[self._gather],
                                              attn_mask=self._meta.mask, enable_gqa=True)


@dataclass
class CacheViews:
    """A plain cache's per-layer views, made once: (K, V) as [slots, Hkv, 1, D] to write token-major rows into and
    as [slots, Hkv, D] to gather from; `heads` [1, Hkv, 1] indexes the KV heads of a gather."""

    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    heads: torch.Tensor
    source: torch.Tensor  # the cache's K tensor they view (a closed engine's cache is replaced)

    @classmethod
    def of(cls, cache: KVCache) -> CacheViews | None:
        """None for a cache that stores another dtype than it computes in (int8, fp8: `PagedAttention` decodes)."""
        if cache.quantized or cache.store_dtype != cache.compute_dtype:
            return None
        layers = [(k[:, :, None], v[:, :, None], k, v) for k, v in zip(cache.k.unbind(0), cache.v.unbind(0))]
        heads = torch.arange(cache.k.shape[2], device=cache.k.device).view(1, -1, 1)
        return cls(layers, heads, cache.k)


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
        # the host side of every step's one copy: int64, pinned on CUDA (a non-blocking copy), grown on demand
        self._host = torch.zeros(0, dtype=torch.long)
        self._views: CacheViews | bool | None = None  # the cache's per-layer views (False: a quantized cache)

    def can_run(self, n: int) -> bool:
        return bucket_for(n, self.buckets) is not None

    def _entry(self, b: int, L: int) -> _Entry:
        e = self.entries.get((b, L))
        if e is None:
            nblk = -(-L // self.block_size)
            keys = torch.arange(L, device=self.device)
            e = self.entries[(b, L)] = _Entry(
                inputs=torch.zeros(b * (2 + nblk), dtype=torch.long, device=self.device), keys=keys,
                key_block=keys // self.block_size, key_offset=keys % self.block_size,
                query_index=torch.zeros(b, 1, dtype=torch.long, device=self.device),
                unpad_index=torch.arange(b, device=self.device))
        return e

    def _host_buffer(self, size: int) -> np.ndarray:
        """The first `size` entries of the host buffer, as numpy (grown to twice the need when too small)."""
        if self._host.numel() < size:
            self._host = torch.zeros(2 * size, dtype=torch.long, pin_memory=self.device.type == "cuda")
            self._host_np = self._host.numpy()
        return self._host_np[:size]

    def _forward(self, e: _Entry) -> torch.Tensor:
        if self._views is None or (self._views and self._views.source is not self.cache.k):
            self._views = CacheViews.of(self.cache) or False
        attention = StaticDecodeAttention(self.cache, e, self.block_size, self._views or None)
        return self.model.hidden_states(e.input_ids, e.positions, attention=attention)

    @torch.inference_mode()
    def run(self, ids: list[int], pos: list[int], ctx_lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One decode step of n rows -> hidden states [n, H] (padded to a bucket, replayed if captured).

        The host fills one buffer (numpy) and copies it to the entry's static `inputs` once. The copy is
        non-blocking from pinned memory on CUDA: the host buffer is reused by the next step, after this step's
        sampled tokens came back (the engine's one sync per step)."""
        n = len(ids)
        b = bucket_for(n, self.buckets)
        if b is None:
            raise ValueError(f"decode step of {n} rows is larger than the largest graph bucket {self.buckets[-1]}")
        L = context_bucket(max(ctx_lens), self.block_size, self.max_model_len)
        e = self._entry(b, L)
        host = self._host_buffer(e.inputs.numel())
        host[:n], host[b:b + n] = ids, pos
        host[n:b], host[b + n:2 * b] = ids[0], pos[0]  # padding rows: copies of row 0 (module docstring)
        rows = host[2 * b:].reshape(b, -1)
        rows[:n] = padded_tables(tables, rows.shape[1])
        rows[n:] = rows[0]
        e.inputs.copy_(self._host[:e.inputs.numel()], non_blocking=True)
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
