"""FlexAttention over the paged KV cache: the engine's fast path on CUDA.

Same maths and same interface as `PagedAttention` (the `attention(layer_idx, q, k, v)` callable the model's
layers call), with `torch.nn.attention.flex_attention` in place of `scaled_dot_product_attention`:
- the K/V of each sequence are gathered once per layer through its block table (`AttentionMetadata`), as in
  `PagedAttention`;
- which (query, key) pairs may attend is a `BlockMask` built once per step from the metadata's causal mask.
  Flex skips every 128 x 128 tile the mask rules out, so the padding of a ragged batch (short sequences padded
  to the longest) costs no compute, where SDPA with a dense mask computes it all and throws it away;
- compiled (`torch.compile`), flex generates one fused Triton kernel on CUDA. Uncompiled it runs an eager
  reference that materializes the scores: fine for tests on CPU, slow for serving.

`attention_backends.select_attention_backend` picks flex on CUDA unless `enforce_eager` (the vLLM flag: no
compilation, no graphs) or a float64 model (the kernel cannot compile for it), and SDPA everywhere else.
"""
from __future__ import annotations

import functools

import torch

from lab_utils.engine.attention import AttentionMetadata, PagedAttention
from lab_utils.engine.kv.kv_cache import KVCache

def flex_available() -> bool:
    """True if this torch ships FlexAttention (torch >= 2.5)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


# torch.compile backend for flex: "inductor" generates the fused kernel (Triton on CUDA); tests on a CPU use
# "aot_eager" to check tracing and recompiles without a C++ build (Inductor's CPU flex template can fail to build)
COMPILE_BACKEND = "inductor"
# Dynamo keeps one compiled variant per guard set, per code object, process-wide: batch 1 vs > 1 and each model's
# head shape and dtype are separate variants. Past `recompile_limit` (8 by default) it silently runs flex
# uncompiled (the dense reference) for the rest of the process, so a notebook that builds several engines would
# slow down without a word. The engine raises the limit to this floor.
RECOMPILE_LIMIT = 64


def _raise_recompile_limit(floor: int = RECOMPILE_LIMIT) -> None:
    import torch._dynamo.config as dc

    name = "recompile_limit" if hasattr(dc, "recompile_limit") else "cache_size_limit"  # older torch
    if getattr(dc, name) < floor:
        setattr(dc, name, floor)


@functools.lru_cache(maxsize=4)
def _flex_fn(compiled: bool, backend: str = "inductor"):
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    _raise_recompile_limit()
    # dynamic: the batch and context lengths change every step; one kernel serves them all
    return torch.compile(flex_attention, dynamic=True, backend=backend)


def build_block_mask(meta: AttentionMetadata):
    """The step's causal + padding mask [B, 1, Q, L] as a flex BlockMask (shared by all layers and heads)."""
    from torch.nn.attention.flex_attention import create_block_mask

    dense = meta.mask[:, 0]  # [B, Q, L]

    def mask_mod(b, h, q_idx, kv_idx):
        return dense[b, q_idx, kv_idx]

    B, Q, L = dense.shape
    return create_block_mask(mask_mod, B, None, Q, L, device=dense.device)


class FlexPagedAttention(PagedAttention):
    """`PagedAttention` with flex_attention: the callable the model's layers call during an engine step."""

    def __init__(self, cache: KVCache, meta: AttentionMetadata, compiled: bool | None = None) -> None:
        super().__init__(cache, meta)
        self.compiled = cache.k.device.type == "cuda" if compiled is None else compiled
        self.block_mask = build_block_mask(meta)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m = self.meta
        q, k, v = q[0], k[0], v[0]  # [N, H, D]: the step's tokens, flat
        self.cache.write(layer_idx, m.slot_mapping, k, v)
        keys, values = self.cache.read(layer_idx, m.context_slots)  # [B, L, Hkv, D]
        qp = q[m.query_index] if not m.decode_only else q[:, None]  # [B, Q, Hq, D]
        # one memory layout for q in every step (decode rows and gathered prefill rows differ otherwise; a clone,
        # not .contiguous(), so a 1-query step gets the same strides too): Dynamo guards on strides, and two
        # layouts would double the compiled variants
        out = _flex_fn(self.compiled, COMPILE_BACKEND)(
            qp.transpose(1, 2).clone(memory_format=torch.contiguous_format), keys.transpose(1, 2),
            values.transpose(1, 2),
            block_mask=self.block_mask, enable_gqa=True,
        )  # [B, Hq, Q, D]
        out = out.transpose(1, 2)
        out = out[:, 0] if m.decode_only else out.reshape(-1, *out.shape[2:])[m.unpad_index]
        return out[None]
