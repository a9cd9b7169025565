"""Weight-only INT8 / INT4 linears: error bounds against nn.Linear, packed storage, and quantize_model."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lab_utils.quant.formats import fake_quant_int, unpack_int4
from lab_utils.quant.linear import (
    Int4Linear,
    Int8Linear,
    W8A8Linear,
    bits_per_weight,
    quantize_groups_int8,
    quantize_model,
    tensor_bytes,
)
from lab_utils.quant.quantize import QuantConfig, ptq


@pytest.fixture
def tiny_model():
    """A fresh 2-layer random model per test (quantize_model changes it in place)."""
    from lab_utils import load_model

    return load_model("tiny-random", device="cpu", dtype=torch.float32)[0]


def make_linear(i=128, o=48, bias=False, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(i, o, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(torch.exp(torch.randn(o, 1)))  # rows of different magnitude, like real weights
    return lin


def test_int8_linear_matches_its_error_bound():
    lin = make_linear(bias=True)
    q = Int8Linear.from_linear(lin)
    assert q.qweight.dtype == torch.int8 and q.scale.shape == (48,)
    x = torch.randn(5, 7, 128)
    with torch.no_grad():
        y_ref, y = lin(x), q(x)
    # |Σ_i x_i (w_i − ŵ_i)| ≤ Σ_i |x_i| · scale_o / 2 for every output o
    bound = x.abs().sum(-1, keepdim=True) * q.scale / 2
    assert bool(((y - y_ref).abs() <= bound * 1.001 + 1e-5).all())
    assert torch.allclose(q.dequantized_weight(), fake_quant_int(lin.weight.detach(), 8, True, "channel"), atol=1e-7)
    assert (y - y_ref).abs().max() < 0.02 * y_ref.abs().max()


def test_activation_groups_round_to_int8_with_one_scale_per_32_inputs():
    x = torch.randn(3, 96) * torch.tensor([100.0, 0.001, 1.0]).repeat_interleave(32)
    x[1, 32:64] = 0
    q, s = quantize_groups_int8(x)
    assert q.dtype == torch.int8 and s.shape == (3, 3) and int(q.abs().max()) == 127
    assert s[1, 1] == 1 and bool((q[1, 32:64] == 0).all())  # an all-zero group: scale 1, no division by 0
    err = (q.float().view(3, 3, 32) * s.unsqueeze(-1)).view(3, 96) - x
    assert bool((err.abs().view(3, 3, 32) <= s.unsqueeze(-1) / 2 * 1.001).all())  # half a step, per group
    assert s[0, 1] < 1e-4, "a small group keeps its own fine scale (a per-token scale would be ~100/127)"
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_groups_int8(torch.randn(2, 48))


def test_w8a8_linear_error_and_its_in_features_check():
    lin = make_linear(bias=True)
    q = W8A8Linear.from_linear(lin)
    x = torch.randn(5, 7, 128)
    with torch.no_grad():
        y_ref, y8, y = lin(x), Int8Linear.from_linear(lin)(x), q(x)
    assert torch.equal(q.qweight, Int8Linear.from_linear(lin).qweight)  # the same stored weights as INT8
    assert (y - y_ref).abs().max() < 0.03 * y_ref.abs().max()
    assert (y - y8).abs().max() > 0, "activations were not quantized"
    with pytest.raises(ValueError, match="w8a8 needs in_features divisible by 32"):
        W8A8Linear.from_linear(nn.Linear(48, 8))
    assert bits_per_weight("w8a8", in_features=128) == bits_per_weight("int8", in_features=128)


def test_quantize_model_w8a8(tiny_model):
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 10))
    with torch.no_grad():
        ref = tiny_model(ids)
    model, saved = quantize_model(tiny_model, "w8a8")
    assert sum(isinstance(m, W8A8Linear) for m in model.modules()) == 14 and saved > 0
    with torch.no_grad():
        out = model(ids)
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_linear_matches_its_error_bound_and_is_packed(symmetric):
    lin = make_linear(i=128, o=32, bias=True, seed=1)
    q = Int4Linear.from_linear(lin, group_size=32, symmetric=symmetric)
    assert q.qweight.dtype == torch.uint8 and q.qweight.shape == (32, 64) and q.scales.shape == (32, 4)
    assert q.scales.dtype == torch.float16 and (q.zeros is None) == symmetric
    ints = unpack_int4(q.qweight, signed=symmetric).to(torch.int16)
    assert (ints.min() >= (-7 if symmetric else 0)) and (ints.max() <= (7 if symmetric else 15))
    x = torch.randn(9, 128)
    with torch.no_grad():
        y_ref, y = lin(x), q(x)
    s = q.scales.float().repeat_interleave(32, dim=1)  # [out, in], the scale of each weight's group
    bound = x.abs() @ (s / 2).T
    assert bool(((y - y_ref).abs() <= bound * 1.001 + 1e-5).all())
    w_err = (q.dequantized_weight() - lin.weight.detach()).abs()
    assert bool((w_err <= s / 2 * 1.001 + 1e-7).all())


def test_bad_group_size_is_a_value_error():
    with pytest.raises(ValueError, match="group_size=48 must be even and divide in_features=128"):
        Int4Linear.from_linear(make_linear(), group_size=48)


def test_quantize_model_replaces_linears_and_reports_bytes(tiny_model):
    model = tiny_model
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        ref = model(ids)
        fq = ptq(model, QuantConfig("int8", "channel"))(ids)
    n_lin = sum(isinstance(m, nn.Linear) for n, m in model.named_modules() if "lm_head" not in n)
    lin_params = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, nn.Linear) and "lm_head" not in n)
    lin_out = sum(m.out_features for n, m in model.named_modules() if isinstance(m, nn.Linear) and "lm_head" not in n)
    before = tensor_bytes(model)
    model, saved = quantize_model(model, "int8")
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == n_lin
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight is model.model.embed_tokens.weight
    assert saved == lin_params * 3 - lin_out * 4 and tensor_bytes(model) == before - saved  # 4 -> 1 byte, + fp32 scales
    with torch.no_grad():
        out = model(ids)
    assert torch.allclose(out, fq, atol=1e-4), "stored INT8 model differs from the simulated one"
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
    with pytest.raises(ValueError, match="no nn.Linear"):
        quantize_model(model, "int8")


def test_quantize_model_int4_and_argument_errors(tiny_model):
    lin_params = sum(m.weight.numel() for n, m in tiny_model.named_modules() if isinstance(m, nn.Linear) and "lm_head" not in n)
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 10))
    with torch.no_grad():
        fq = ptq(tiny_model, QuantConfig("int4", "group", 32))(ids)
    with pytest.raises(ValueError, match="quantization='int3'"):
        quantize_model(tiny_model, "int3")
    with pytest.raises(ValueError, match="group_size=96"):
        quantize_model(tiny_model, "int4", group_size=96)
    model, saved = quantize_model(tiny_model, "int4", group_size=32)
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 14
    expected_after = lin_params * bits_per_weight("int4", 32) / 8
    assert saved == pytest.approx(lin_params * 4 - expected_after)
    with torch.no_grad():
        out = model(ids)
    # the only difference from the simulation: scales rounded to fp16 before the integers are chosen
    assert (out - fq).abs().max() < 0.05 * fq.abs().max()


def test_quantized_layers_follow_the_model_to_a_dtype(tiny_model):
    model, _ = quantize_model(tiny_model, "int4", group_size=32)
    model = model.to(torch.bfloat16)
    layer = model.model.layers[0].mlp.up_proj
    assert layer.qweight.dtype == torch.uint8  # integer buffers are not cast
    with torch.no_grad():
        out = model(torch.randint(0, 100, (1, 5)))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
