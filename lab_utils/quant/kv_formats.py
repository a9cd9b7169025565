"""What a KV cache stores per value, and so what one token costs in it: the one count (the engine's `KVCache`
allocates exactly this; lab 02's capacity figures and lab 05's precision tables read it).

It lives with the number formats, below the engine: the engine's paging (`lab_utils.engine.kv.paging`) and the
precision study of lab 05 (`lab_utils.quant.kv`) both import it, and neither imports the other.
"""
from __future__ import annotations

import torch

# `EngineConfig.kv_cache_dtype` -> what the cache stores ("auto": the model's dtype). "fp8" is FP8 E4M3.
KV_CACHE_DTYPES = {
    "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn, "int8": torch.int8,
}
KV_SCALE_DTYPE = torch.float32  # an int8 cache's scale, one per (token, head) for K and one for V


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, store: torch.dtype) -> int:
    """Bytes of KV cache one token takes: 2 (K and V) x layers x kv_heads x head_dim x bytes per value, plus, for
    int8, one `KV_SCALE_DTYPE` scale per K and V vector."""
    vectors = 2 * num_layers * num_kv_heads
    scales = vectors * KV_SCALE_DTYPE.itemsize if store == torch.int8 else 0
    return vectors * head_dim * store.itemsize + scales
