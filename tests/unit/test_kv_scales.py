"""FP8 KV-cache scales per layer: computed from data they hold every value seen; 1.0 holds values up to 448; a
scale too small saturates, and the attention reads the saturated values."""
from __future__ import annotations

import pytest
import torch

from lab_utils.quant.kv import (
    kv_amax_per_layer,
    kv_quant_attention,
    kv_saturation,
    kv_scales_from_amax,
    quantize_kv,
)


@pytest.fixture(scope="module")
def tiny():
    from lab_utils import load_model

    return load_model("tiny-random", device="cpu", dtype=torch.float32)[0]


def test_scales_from_data_map_each_layers_largest_value_to_448(tiny):
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    amax = kv_amax_per_layer(tiny, ids)
    assert sorted(amax) == [0, 1] and all(k > 0 and v > 0 for k, v in amax.values())
    scales = kv_scales_from_amax(amax)
    assert all(abs(ks * 448 - amax[i][0]) < 1e-9 and abs(vs * 448 - amax[i][1]) < 1e-9 for i, (ks, vs) in scales.items())
    assert kv_saturation(tiny, ids, scales) == (0.0, 0.0)
    # a scale 4x too small for every layer: the largest values no longer fit
    small = {i: (ks / 4, vs / 4) for i, (ks, vs) in scales.items()}
    k_share, v_share = kv_saturation(tiny, ids, small)
    assert k_share > 0 and v_share > 0


def test_saturation_at_448_and_what_the_scale_changes():
    x = torch.tensor([[[[1.0, 100.0, 448.0, 1000.0, -5000.0]]]])
    at_one = quantize_kv(x, "fp8", 1.0)
    assert at_one.flatten().tolist() == [1.0, 96.0, 448.0, 448.0, -448.0]  # E4M3: 100 rounds to 96; beyond 448 clips
    scaled = quantize_kv(x, "fp8", 5000 / 448)
    assert abs(float(scaled.flatten()[-1]) + 5000) < 1e-3 and abs(float(scaled.flatten()[3]) - 1000) < 80


def test_attention_uses_each_layers_own_scales_and_names_bad_ones():
    q = torch.randn(1, 4, 2, 8) / 300  # logits of order 1 over keys of order 1000
    k, v = 1000 * torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    from lab_utils.models.llama import dense_causal_attention

    ref = dense_causal_attention(0, q, k, v)
    one = kv_quant_attention("fp8", 1.0)(0, q, k, v)
    fitted = kv_quant_attention("fp8", {0: (float(k.abs().max()) / 448, float(v.abs().max()) / 448)})(0, q, k, v)
    assert (fitted - ref).abs().max() < (one - ref).abs().max()  # 1.0 saturates keys near 1000
    with pytest.raises(ValueError, match="no fp8 KV scales for layer 1"):
        kv_quant_attention("fp8", {0: (1.0, 1.0)})(1, q, k, v)
    with pytest.raises(ValueError, match="must be positive"):
        kv_quant_attention("fp8", {0: (0.0, 1.0)})
    with pytest.raises(ValueError, match="no per-tensor scale"):
        kv_scales_from_amax({0: (1.0, 1.0)}, "int8")
