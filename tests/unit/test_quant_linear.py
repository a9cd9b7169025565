"""INT8 / INT4 weight-only linears and the two W8A8 linears (vLLM's per-token scales, and per 32 inputs): error
bounds against nn.Linear, the scales factoring out of one integer matmul, packed storage, and quantize_model."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lab_utils.quant.formats import fake_quant_int, unpack_int4
from lab_utils.quant.linear import (
    Int4Linear,
    Int8Linear,
    W8A8GroupLinear,
    W8A8Linear,
    bits_per_weight,
    int8_matmul,
    quantize_groups_int8,
    quantize_model,
    quantize_per_token_int8,
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


def test_w8a8_g32_linear_error_and_its_in_features_check():
    lin = make_linear(bias=True)
    q = W8A8GroupLinear.from_linear(lin)
    x = torch.randn(5, 7, 128)
    with torch.no_grad():
        y_ref, y8, y = lin(x), Int8Linear.from_linear(lin)(x), q(x)
    assert torch.equal(q.qweight, Int8Linear.from_linear(lin).qweight)  # the same stored weights as INT8
    assert (y - y_ref).abs().max() < 0.03 * y_ref.abs().max()
    assert (y - y8).abs().max() > 0, "activations were not quantized"
    with pytest.raises(ValueError, match="w8a8-g32 needs in_features divisible by 32.*use w8a8"):
        W8A8GroupLinear.from_linear(nn.Linear(48, 8))
    assert bits_per_weight("w8a8-g32", in_features=128) == bits_per_weight("int8", in_features=128)


def test_int8_matmul_is_exact():
    torch.manual_seed(0)
    for m, k, n in ((1, 64, 16), (3, 576, 1536), (17, 1536, 576), (2, 48, 5)):
        a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
        b = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        got = int8_matmul(a, b)
        assert got.dtype == torch.int32 and torch.equal(got.long(), a.long() @ b.long().t())
    with pytest.raises(ValueError, match="int8 operands"):
        int8_matmul(a.float(), b)


def test_per_token_scales_factor_out_of_one_integer_matmul():
    """vLLM's W8A8: y = (x_q @ q_wᵀ) · s_x[token] · s_w[channel], an int32 product scaled once; each token's
    scale is its own absmax / 127, whatever else is in the batch."""
    lin = make_linear(i=96, o=40, bias=True, seed=1)  # 96: no multiple of 32 needed (one scale per token)
    q = W8A8Linear.from_linear(lin)
    x = torch.randn(6, 96)
    xq, sx = quantize_per_token_int8(x)
    assert sx.shape == (6, 1) and torch.allclose(sx, x.abs().amax(-1, keepdim=True) / 127)
    acc = (xq.long() @ q.qweight.long().t()).double()
    expect = (acc * sx.double() * q.scale.double() + lin.bias.detach().double()).float()
    with torch.no_grad():
        y = q(x)
    assert torch.allclose(y, expect, rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # batch invariance: a token's output does not depend on its neighbours
        assert torch.allclose(q(x[2:3] * 1.0), y[2:3], rtol=0, atol=0)
        assert torch.allclose(q(torch.cat([x[2:3], 100 * x[:1]])), torch.cat([y[2:3], q(100 * x[:1])]), rtol=0, atol=0)


def test_per_token_w8a8_is_close_to_fp32_and_per_group_closer_with_an_outlier_channel():
    """One activation channel 50x the rest (SmolLM2 has such channels): a per-token scale is set by it and rounds
    every other input coarsely; per 32 inputs, only its own group pays. Both stay close to fp32 without it."""
    lin = make_linear(i=128, o=64, seed=2)
    torch.manual_seed(3)
    x = torch.randn(16, 128)
    with torch.no_grad():
        ref = lin(x)
        tok, grp = W8A8Linear.from_linear(lin)(x), W8A8GroupLinear.from_linear(lin)(x)
        assert (tok - ref).abs().max() < 0.03 * ref.abs().max() and (grp - ref).abs().max() < 0.03 * ref.abs().max()
        x[:, 5] *= 50
        ref = Int8Linear.from_linear(lin)(x)  # the same INT8 weights, float activations: only x's rounding differs
        err_tok = (W8A8Linear.from_linear(lin)(x) - ref).pow(2).mean().sqrt()
        err_grp = (W8A8GroupLinear.from_linear(lin)(x) - ref).pow(2).mean().sqrt()
    assert err_grp < 0.6 * err_tok, (err_grp, err_tok)  # ~ sqrt(32 / 128): a quarter of the inputs pay


@pytest.mark.parametrize("method,cls", [("w8a8", W8A8Linear), ("w8a8-g32", W8A8GroupLinear)])
def test_quantize_model_w8a8(tiny_model, method, cls):
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 10))
    with torch.no_grad():
        ref = tiny_model(ids)
    model, saved = quantize_model(tiny_model, method)
    assert sum(type(m) is cls for m in model.modules()) == 14 and saved > 0
    with torch.no_grad():
        out = model(ids)
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


def test_quantize_model_names_the_methods():
    with pytest.raises(ValueError, match="allowed: int8, int4, w8a8, w8a8-g32"):
        quantize_model(nn.Sequential(nn.Linear(64, 64)), "w8a8-token")


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
