"""Quantization: number formats at the bit level (`formats`), PTQ and QAT (`quantize`), quantized linears
(`linear`, with `quantize_model` for the engine) and KV-cache precision (`kv`). Knows nothing of the engine."""
from lab_utils.quant.linear import Int4Linear, Int8Linear, quantize_model

__all__ = ["Int4Linear", "Int8Linear", "quantize_model"]
