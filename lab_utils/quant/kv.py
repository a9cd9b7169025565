"""KV-cache precision: bytes per token, tokens per budget, and attention that reads a quantized cache.

Each token leaves, in every layer, one key and one value vector per KV head:
    bytes/token = layers × 2 × kv_heads × head_dim × bytes/element (+ scales, if the format has them),
the engine's own count (`lab_utils.quant.kv_formats.bytes_per_token`, what its `KVCache` allocates).
For SmolLM2-135M (30 layers, 3 KV heads of 64): 11,520 elements per token, 45 KiB in fp32, 11.25 KiB in fp8.

`kv_quant_attention(kind)` returns an attention callable for `model(ids, attention=...)` that rounds K and V
to the cache format before attending: the accuracy cost of a quantized cache, measurable without an engine.
- "fp16"/"bf16": plain casts. "fp8_e4m3"/"fp8_e5m2": x stored as fp8(x / scale), one scale for K and one for V
  per layer (vLLM's `k_scale`/`v_scale`: 1.0 unless the checkpoint brings calibrated ones). Values beyond
  ±max × scale saturate (E4M3: 448, it has no infinity). `kv_amax_per_layer` and `kv_scales_from_amax` compute
  per-layer scales from data, each layer's largest |K| and |V| mapped to the format's max.
- "int8": symmetric, one scale per (token, head) vector, stored in fp32 next to it (4 bytes per head_dim values),
  as the engine's cache stores it.
"""
from __future__ import annotations

from collections.abc import Mapping

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


def kv_quant_attention(kind: str, fp8_scale: float | Mapping[int, tuple[float, float]] = 1.0):
    """An attention callable that stores K/V in `kind` and attends over the rounded values (queries stay float).
    `fp8_scale`: one scale for every K and V, or per layer {layer: (k_scale, v_scale)} (`kv_scales_from_amax`)."""
    _kind(kind)
    if isinstance(fp8_scale, Mapping):
        bad = {i: s for i, s in fp8_scale.items() if len(s) != 2 or not all(x > 0 for x in s)}
    else:
        bad = {} if fp8_scale > 0 else {"all": fp8_scale}
    if bad:
        raise ValueError(f"fp8 KV scales must be positive, (k_scale, v_scale) per layer; got {bad}")

    def attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if isinstance(fp8_scale, Mapping):
            if layer_idx not in fp8_scale:
                raise ValueError(f"no fp8 KV scales for layer {layer_idx}: the scales cover layers "
                                 f"{sorted(fp8_scale)}; compute them on this model (kv_scales_from_amax)")
            ks, vs = fp8_scale[layer_idx]
        else:
            ks = vs = fp8_scale
        return dense_causal_attention(layer_idx, q, quantize_kv(k, kind, ks), quantize_kv(v, kind, vs))

    return attention


@torch.no_grad()
def kv_amax_per_layer(model, ids: torch.Tensor) -> dict[int, tuple[float, float]]:
    """{layer: (largest |K|, largest |V|)} over the tokens `ids` [N, T] (a calibration pass, full precision)."""
    amax: dict[int, tuple[float, float]] = {}

    def record(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k0, v0 = amax.get(layer_idx, (0.0, 0.0))
        amax[layer_idx] = (max(k0, float(k.abs().max())), max(v0, float(v.abs().max())))
        return dense_causal_attention(layer_idx, q, k, v)

    model(ids, attention=record)
    return amax


def kv_scales_from_amax(amax: Mapping[int, tuple[float, float]], kind: str = "fp8") -> dict[int, tuple[float, float]]:
    """Per-layer (k_scale, v_scale) that map each layer's largest |K| and |V| to the format's largest value, so
    nothing seen in calibration saturates (an all-zero tensor keeps 1.0)."""
    k = _kind(kind)
    if k not in _FORMATS:
        raise ValueError(f"kv cache dtype {kind!r} has no per-tensor scale; use 'fp8' or 'fp8_e5m2'")
    top = FLOAT_FORMATS[_FORMATS[k]].max_value
    return {i: tuple(a / top if a > 0 else 1.0 for a in kv) for i, kv in amax.items()}


@torch.no_grad()
def kv_saturation(model, ids: torch.Tensor, scales: float | Mapping[int, tuple[float, float]],
                  kind: str = "fp8") -> tuple[float, float]:
    """The shares of K and of V values over `ids` that the scales cannot hold (|x| > max × scale): an fp8 cache
    stores them as ±max."""
    top = FLOAT_FORMATS[_FORMATS[_kind(kind)]].max_value
    counts = [0, 0, 0]  # K beyond, V beyond, values per tensor

    def record(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ks, vs = scales[layer_idx] if isinstance(scales, Mapping) else (scales, scales)
        counts[0] += int((k.abs() > top * ks).sum())
        counts[1] += int((v.abs() > top * vs).sum())
        counts[2] += k.numel()
        return dense_causal_attention(layer_idx, q, k, v)

    model(ids, attention=record)
    return counts[0] / counts[2], counts[1] / counts[2]
