"""KV-cache precision: bytes per token, tokens per budget, and attention that reads a quantized cache.

Each token leaves, in every layer, one key and one value vector per KV head:
    bytes/token = layers × 2 × kv_heads × head_dim × bytes/element (+ scales, if the format has them),
the engine's own count (`lab_utils.quant.kv_formats.bytes_per_token`, what its `KVCache` allocates).
For SmolLM2-135M (30 layers, 3 KV heads of 64): 11,520 elements per token, 45 KiB in fp32, 11.25 KiB in fp8.

`kv_quant_attention(kind)` returns an attention callable for `model(ids, attention=...)` that rounds K and V
to the cache format before attending: the accuracy cost of a quantized cache, measurable without an engine.
- "fp16"/"bf16": plain casts. "fp8_e4m3"/"fp8_e5m2": cast with a per-tensor scale (1.0 by default, as vLLM
  does when no calibrated scale is given; values beyond ±max saturate).
- "int8": symmetric, one scale per (token, head) vector, stored in fp32 next to it (4 bytes per head_dim values),
  as the engine's cache stores it.
"""
from __future__ import annotations

import torch

from lab_utils.models.llama import dense_causal_attention
from lab_utils.quant.formats import FLOAT_FORMATS
from lab_utils.quant.kv_formats import KV_CACHE_DTYPES, KV_SCALE_DTYPE, bytes_per_token

# the engine's names (`EngineConfig.kv_cache_dtype`; "fp8" is FP8 E4M3), and FP8 E5M2, measured here only
KV_DTYPES = (*KV_CACHE_DTYPES, "fp8_e5m2")
_STORE = {**KV_CACHE_DTYPES, "fp8_e5m2": torch.float8_e5m2}
_FORMATS = {"fp8": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}  # `lab_utils.quant.formats` names of the FP8 formats
_ALIASES = {"fp8_e4m3": "fp8", "float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _kind(kind: str) -> str:
    k = _ALIASES.get(kind, kind)
    if k not in KV_DTYPES:
        raise ValueError(f"kv cache dtype {kind!r}; allowed: {', '.join(KV_DTYPES)} (or 'fp8_e4m3')")
    return k


def kv_bytes_per_token(config, kind: str = "fp32") -> int:
    """Bytes one token occupies in the KV cache of a model with this config (int8 adds a scale per vector)."""
    return bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, _STORE[_kind(kind)])


def tokens_in_budget(config, budget_bytes: int, kind: str = "fp32") -> int:
    return int(budget_bytes // kv_bytes_per_token(config, kind))


def quantize_kv(x: torch.Tensor, kind: str, fp8_scale: float = 1.0) -> torch.Tensor:
    """Round K or V [B, T, H, D] to the cache format and back (what attention will read)."""
    k = _kind(kind)
    if k == "fp32":
        return x
    if k in ("fp16", "bf16"):
        return x.to(torch.float16 if k == "fp16" else torch.bfloat16).to(x.dtype)
    if k == "int8":
        amax = x.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).to(KV_SCALE_DTYPE).clamp(min=1e-7)
        return (torch.clamp(torch.round(x.float() / scale), -127, 127) * scale).to(x.dtype)
    fmt = FLOAT_FORMATS[_FORMATS[k]]
    return (fmt.round_tensor(x.float() / fp8_scale, saturate=True) * fp8_scale).to(x.dtype)


def kv_quant_attention(kind: str, fp8_scale: float = 1.0):
    """An attention callable that stores K/V in `kind` and attends over the rounded values (queries stay float)."""
    _kind(kind)

    def attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dense_causal_attention(layer_idx, q, quantize_kv(k, kind, fp8_scale), quantize_kv(v, kind, fp8_scale))

    return attention
