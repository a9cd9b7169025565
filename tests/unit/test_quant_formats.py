"""Bit layouts checked bit-exactly against torch's own dtypes; integer quantization error bounds; INT4 packing."""
from __future__ import annotations

import math

import pytest
import torch

from lab_utils.quant.formats import (
    BF16,
    FP8_E4M3,
    FP8_E5M2,
    FP16,
    FP32,
    compute_qparams,
    dequantize_int,
    fake_quant_float,
    fake_quant_int,
    float_format,
    format_table,
    max_abs_error,
    mse,
    pack_int4,
    qrange,
    quantize_int,
    sqnr_db,
    unpack_int4,
)

TORCH_CHECKED = [FP16, BF16, FP8_E4M3, FP8_E5M2]
ids = [f.name for f in TORCH_CHECKED]


def torch_values_of_all_patterns(fmt):
    """Every bit pattern reinterpreted as the torch dtype, as float64 (NaN stays NaN)."""
    bits = torch.arange(2**fmt.bits, dtype=torch.int32)
    raw = bits.to(torch.uint8) if fmt.bits == 8 else bits.to(torch.int16)  # int16 wraps: same bits
    return bits.long(), raw.view(fmt.torch_dtype).double()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN == NaN, and -0.0 distinguished from +0.0."""
    both_nan = torch.isnan(a) & torch.isnan(b)
    eq = (a == b) & (torch.signbit(a) == torch.signbit(b))
    return bool((both_nan | eq).all())


def torch_bits(x: torch.Tensor, fmt) -> torch.Tensor:
    y = x.to(fmt.torch_dtype)
    return (y.view(torch.uint8).long() if fmt.bits == 8 else y.view(torch.int16).long() & 0xFFFF)


@pytest.mark.parametrize("fmt", TORCH_CHECKED, ids=ids)
def test_decode_every_bit_pattern_matches_torch(fmt):
    bits, expected = torch_values_of_all_patterns(fmt)
    assert same(fmt.decode_tensor(bits), expected)
    step = 1 if fmt.bits == 8 else 7  # the scalar path on a subset of the 16-bit patterns (speed)
    scalar = torch.tensor([fmt.decode(int(b)) for b in bits[::step]], dtype=torch.float64)
    assert same(scalar, expected[::step])


@pytest.mark.parametrize("fmt", TORCH_CHECKED, ids=ids)
def test_encode_of_every_value_gives_back_its_bits(fmt):
    bits, values = torch_values_of_all_patterns(fmt)
    keep = ~torch.isnan(values)
    assert torch.equal(fmt.encode_tensor(values[keep]), bits[keep])
    step = 1 if fmt.bits == 8 else 5
    sub_v, sub_b = values[keep][::step], bits[keep][::step]
    assert [fmt.encode(float(v)) for v in sub_v] == sub_b.tolist()


@pytest.mark.parametrize("fmt", TORCH_CHECKED, ids=ids)
def test_ties_and_near_ties_round_like_torch(fmt):
    """Midpoints between neighbours (ties -> even mantissa) and one float32 ulp either side."""
    vals = fmt.all_values()
    vals = vals[vals <= fmt.max_value]
    mids = ((vals[:-1] + vals[1:]) / 2).float()  # exact in float32 for these formats
    assert torch.equal(mids.double(), (vals[:-1] + vals[1:]) / 2)
    up, down = torch.nextafter(mids, torch.tensor(math.inf)), torch.nextafter(mids, torch.tensor(0.0))
    x = torch.cat([mids, up, down, -mids, -up])
    assert torch.equal(fmt.encode_tensor(x), torch_bits(x, fmt))
    assert [fmt.encode(float(v)) for v in x[:: max(1, x.numel() // 3000)]] == torch_bits(x, fmt)[
        :: max(1, x.numel() // 3000)].tolist()


@pytest.mark.parametrize("fmt", TORCH_CHECKED, ids=ids)
def test_random_values_subnormals_and_overflow_match_torch(fmt):
    g = torch.Generator().manual_seed(0)
    n = 100_000
    mag = torch.exp2(torch.empty(n).uniform_(math.log2(fmt.min_subnormal) - 3, math.log2(fmt.max_value) + 2, generator=g))
    sub = torch.rand(n // 10, generator=g) * fmt.min_normal  # the subnormal range itself
    x = torch.cat([mag, sub]) * torch.where(torch.rand(n + n // 10, generator=g) < 0.5, -1.0, 1.0)
    x = torch.cat([x, torch.tensor([0.0, -0.0, math.inf, -math.inf, fmt.max_value * 1.01, -fmt.max_value * 4])]).float()
    # how this torch's cast treats overflow: E4M3 saturates in torch 2.13, gives NaN in 2.11 (IEEE formats: inf)
    big = torch.tensor([fmt.max_value * 4]).to(fmt.torch_dtype).double()
    sat = bool(torch.isfinite(big).all())
    assert sat == fmt.saturate_default or fmt.name == "fp8_e4m3", "only E4M3's overflow differs between torch versions"
    assert torch.equal(fmt.encode_tensor(x, sat), torch_bits(x, fmt)), "vectorised encode differs from torch"
    picks = x[::37]
    assert [fmt.encode(float(v), sat) for v in picks] == torch_bits(picks, fmt).tolist(), "scalar encode differs"
    assert same(fmt.round_tensor(x, sat).double(), x.to(fmt.torch_dtype).double())


def test_fp32_random_bit_patterns_and_rounding_from_double():
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(0, 2**32, (50_000,), generator=g, dtype=torch.int64)
    as_f32 = bits.to(torch.int32).view(torch.float32).double()  # int64 -> int32 wraps: the same 32 bits
    assert same(FP32.decode_tensor(bits), as_f32)
    assert all(same(torch.tensor([FP32.decode(int(b))], dtype=torch.float64), as_f32[i: i + 1])
               for i, b in enumerate(bits[:2000]))
    d = torch.randn(50_000, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-150, 128, (50_000,), generator=g)).double()
    expect = d.float().view(torch.int32).long() & 0xFFFFFFFF
    assert torch.equal(FP32.encode_tensor(d), expect)
    assert [FP32.encode(float(v)) for v in d[:2000]] == expect[:2000].tolist()


def test_overflow_behaviour_is_the_documented_one():
    # E4M3 (fn): no infinity. Saturating (the default, like torch's cast) clamps; non-saturating gives NaN
    assert FP8_E4M3.max_value == 448 and FP8_E5M2.max_value == 57344 and FP16.max_value == 65504
    assert FP8_E4M3.decode(FP8_E4M3.encode(1e6)) == 448 and FP8_E4M3.decode(FP8_E4M3.encode(-math.inf)) == -448
    assert math.isnan(FP8_E4M3.decode(FP8_E4M3.encode(1e6, saturate=False)))
    assert FP8_E4M3.decode(FP8_E4M3.encode(463.9, saturate=False)) == 448  # below the 448/480 midpoint
    assert FP8_E4M3.decode(FP8_E4M3.encode(464, saturate=False)) == 448  # tie -> even mantissa (110)
    assert math.isnan(FP8_E4M3.decode(FP8_E4M3.encode(465, saturate=False)))  # 480 would be S.1111.111 = NaN
    # IEEE formats: round to inf at max + half an ulp (the tie goes to the even "next binade" = inf)
    assert FP8_E5M2.decode(FP8_E5M2.encode(61439)) == 57344 and FP8_E5M2.decode(FP8_E5M2.encode(61440)) == math.inf
    assert FP8_E5M2.decode(FP8_E5M2.encode(1e9, saturate=True)) == 57344
    assert FP16.decode(FP16.encode(65519)) == 65504 and FP16.decode(FP16.encode(65520)) == math.inf
    assert math.isnan(FP16.decode(FP16.encode(math.nan))) and FP16.is_nan_bits(FP16.encode(math.nan))


def test_double_rounding_through_float32_is_avoided():
    x = 1 + 2**-4 + 2**-30  # just above the 1.0 / 1.125 tie in E4M3
    assert FP8_E4M3.decode(FP8_E4M3.encode(x)) == 1.125
    assert torch.tensor([x], dtype=torch.float32).to(torch.float8_e4m3fn).item() == 1.0  # the float32 path


def test_fields_subnormals_and_explain():
    assert FP8_E4M3.fields(FP8_E4M3.encode(1.25)) == (0, 7, 2)
    assert FP8_E4M3.from_fields(1, 0, 1) == FP8_E4M3.encode(-2**-9)
    assert FP8_E4M3.min_subnormal == 2**-9 and FP8_E5M2.min_subnormal == 2**-16 and FP16.min_subnormal == 2**-24
    assert FP8_E4M3.decode(FP8_E4M3.encode(2**-10)) == 0.0  # tie between 0 and the smallest subnormal -> 0
    assert FP8_E4M3.decode(FP8_E4M3.encode(3 * 2**-11)) == 2**-9
    assert "subnormal" in FP8_E4M3.explain(1) and "2^0" in FP8_E4M3.explain(FP8_E4M3.encode(1.0))
    assert FP8_E4M3.all_values().numel() == 127  # 0, 7 subnormals... up to 448; NaN excluded
    with pytest.raises(ValueError, match="outside"):
        FP8_E4M3.decode(256)
    with pytest.raises(ValueError, match="unknown float format"):
        float_format("fp7")
    rows = {r["format"]: r for r in format_table()}
    assert rows["fp8_e4m3"]["max"] == 448 and rows["bf16"]["exponent_bits"] == 8 and rows["int4"]["max"] == 7


# ------------------------------------------------------------------------------------------------------------
# integer quantization
# ------------------------------------------------------------------------------------------------------------
def per_element_scale(qt, shape):
    s = qt.scale
    if qt.granularity == "group":
        s = s.repeat_interleave(qt.group_size, dim=-1)
    return s.expand(shape)


@pytest.mark.parametrize("bits", [8, 4, 3])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("granularity", ["tensor", "channel", "group"])
def test_round_to_nearest_error_is_at_most_half_a_step(bits, symmetric, granularity):
    g = torch.Generator().manual_seed(bits * 10 + symmetric)
    x = torch.randn(48, 96, generator=g) * torch.exp(torch.randn(48, 1, generator=g)) + 0.3 * symmetric
    qt = quantize_int(x, bits, symmetric, granularity, group_size=32)
    qmin, qmax = qrange(bits, symmetric)
    assert int(qt.q.min()) >= qmin and int(qt.q.max()) <= qmax
    err = (x - qt.dequantize()).abs()
    bound = per_element_scale(qt, x.shape) / 2
    assert bool((err <= bound * (1 + 1e-5) + 1e-7).all()), f"max err/scale = {float((err / (2 * bound)).max())}"
    assert torch.equal(fake_quant_int(x, bits, symmetric, granularity, 32), qt.dequantize())


def test_symmetric_int8_known_values_and_zero_handling():
    x = torch.tensor([[-1.0, 0.0, 0.5, 1.0], [0.0, 0.0, 0.0, 0.0]])
    qt = quantize_int(x, 8, True, "channel")
    assert qt.q.dtype == torch.int8 and qt.q[0].tolist() == [-127, 0, 64, 127]  # 63.5 -> 64 (ties to even)
    assert qt.scale[1].item() == 1.0 and qt.q[1].abs().sum() == 0  # an all-zero row gets a harmless scale
    assert torch.allclose(qt.scale[0], torch.tensor(1 / 127))


def test_asymmetric_uses_the_full_range_and_keeps_zero_exact():
    x = torch.tensor([[0.0, 0.1, 2.5, 5.0]])
    qt = quantize_int(x, 8, False, "tensor")
    assert qt.q.dtype == torch.uint8 and int(qt.q.min()) == 0 and int(qt.q.max()) == 255
    assert qt.dequantize()[0, 0].item() == 0.0
    y = torch.rand(1, 1000, generator=torch.Generator().manual_seed(0)) * 5  # all positive (e.g. after ReLU)
    sym, asym = fake_quant_int(y, 4, True, "tensor"), fake_quant_int(y, 4, False, "tensor")
    assert mse(y, asym) < 0.5 * mse(y, sym)  # a one-sided range wastes half the symmetric grid


def test_finer_granularity_and_more_bits_lower_the_error():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g) * torch.exp(2 * torch.randn(64, 1, generator=g))
    errs = [mse(w, fake_quant_int(w, 4, True, gr, 32)) for gr in ("tensor", "channel", "group")]
    assert errs[0] > errs[1] > errs[2]
    sq = [sqnr_db(w, fake_quant_int(w, b, True, "channel")) for b in (4, 6, 8)]
    assert 10 < sq[1] - sq[0] < 14 and 10 < sq[2] - sq[1] < 14  # ~6 dB per bit
    assert max_abs_error(w, w) == 0 and sqnr_db(w, w) == math.inf


def test_reused_scales_and_bad_arguments():
    x = torch.randn(8, 64)
    scale, zp = compute_qparams(x, 8, False, "group", 16)
    a = quantize_int(x, 8, False, "group", 16)
    b = quantize_int(x, 8, False, "group", 16, scale=scale, zero_point=zp)
    assert torch.equal(a.q, b.q) and torch.equal(dequantize_int(a), dequantize_int(b))
    with pytest.raises(ValueError, match="group_size=24 does not divide"):
        quantize_int(x, 4, True, "group", 24)
    with pytest.raises(ValueError, match="granularity"):
        quantize_int(x, 4, True, "row")
    with pytest.raises(ValueError, match="bits=1"):
        qrange(1, True)


def test_scaled_fp8_weights_beat_int4_and_lose_to_int8():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(128, 256, generator=g) * 0.02
    s8, s_fp8, s4 = (sqnr_db(w, fake_quant_int(w, 8)), sqnr_db(w, fake_quant_float(w, FP8_E4M3)),
                     sqnr_db(w, fake_quant_int(w, 4)))
    assert s4 < s_fp8 < s8
    assert float(fake_quant_float(w, "fp8_e4m3").abs().max()) == pytest.approx(float(w.abs().max()), rel=1e-6)


# ------------------------------------------------------------------------------------------------------------
# INT4 packing
# ------------------------------------------------------------------------------------------------------------
def test_int4_pack_round_trip_and_layout():
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-8, 8, (7, 64), generator=g, dtype=torch.int8)
    p = pack_int4(q)
    assert p.dtype == torch.uint8 and p.shape == (7, 32)
    assert torch.equal(unpack_int4(p), q)
    u = torch.randint(0, 16, (3, 10), generator=g)
    assert torch.equal(unpack_int4(pack_int4(u), signed=False), u.to(torch.uint8))
    assert pack_int4(torch.tensor([1, -1])).item() == 0xF1  # low nibble first, two's complement
    all_pairs = torch.cartesian_prod(torch.arange(-8, 8), torch.arange(-8, 8))
    assert torch.equal(unpack_int4(pack_int4(all_pairs)), all_pairs.to(torch.int8))
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(3))
    with pytest.raises(ValueError, match="-8..7"):
        pack_int4(torch.tensor([0, 16]))
