"""Lab 05's checkers accept correct solutions and reject each common mistake with a message that names it."""
from __future__ import annotations

import math

import pytest
import torch

from lab_utils.course import learner_parts
from lab_utils.checks import lab05
from lab_utils.engine.kv.kv_cache import fp8_decode, fp8_encode
from lab_utils.course.parts import EngineParts
from lab_utils.quant.formats import FP8_E4M3
from lab_utils.quant.linear import (
    dequantize_int4,
    quantize_per_channel_int8,
    quantize_per_group_int4,
)


@pytest.fixture(autouse=True)
def learner_dir(tmp_path, monkeypatch):
    """Checks that pass submit the part: keep the saved files out of the repository."""
    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path / "my_engine"))
    learner_parts.forget()
    yield
    learner_parts.forget()


# --- encode E4M3 -------------------------------------------------------------------------------------------------
def good_encode(x: float) -> int:  # an independent solution: search the 127 magnitudes
    if math.isnan(x):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = min(abs(x), 448.0)
    best = min(range(127), key=lambda b: (abs(FP8_E4M3.decode(b) - a), b & 1))  # nearest, ties -> even mantissa
    return sign | best


def variant(**kw):
    def enc(x: float) -> int:
        if math.isnan(x):
            return 0x7F
        sign = 0x80 if math.copysign(1.0, x) < 0 and not kw.get("no_sign") else 0
        a = abs(x)
        if a > 448 or math.isinf(a):
            return sign | (0x7F if kw.get("overflow_nan") else 0x7E)
        if a == 0:
            return sign
        e = max(math.frexp(a)[1] - 1, -6 if not kw.get("no_subnormals") else -100)
        if kw.get("no_subnormals") and e < -6:
            return sign
        q = a / 2.0 ** (e - 3)
        if kw.get("truncate"):
            r = math.floor(q)
        elif kw.get("half_up"):
            r = math.floor(q + 0.5)
        else:
            r = round(q)
        v = min(r * 2.0 ** (e - 3), 448.0)
        return sign | FP8_E4M3._magnitude_bits(v)
    return enc


def test_encode_checker_accepts_correct(capsys):
    lab05.check_encode_e4m3(good_encode, seed=0)
    lab05.check_encode_e4m3(good_encode)  # fresh random inputs
    lab05.check_encode_e4m3(variant())
    assert "check_encode_e4m3 passed" in capsys.readouterr().out


@pytest.mark.parametrize("kw, message", [
    (dict(truncate=True), "toward zero"),
    (dict(half_up=True), "halfway"),
    (dict(no_subnormals=True), "subnormal"),
    (dict(overflow_nan=True), "saturate to ±448"),
    (dict(no_sign=True), "sign bit"),
])
def test_encode_checker_names_each_mistake(kw, message):
    with pytest.raises(AssertionError, match=message) as e:
        lab05.check_encode_e4m3(variant(**kw), seed=1)
    assert "expected 0x" in str(e.value)


def test_encode_checker_rejects_wrong_types_and_nan():
    with pytest.raises(AssertionError, match="Python int"):
        lab05.check_encode_e4m3(lambda x: float(good_encode(x)), seed=2)
    with pytest.raises(AssertionError, match="NaN must encode"):
        lab05.check_encode_e4m3(lambda x: 0 if math.isnan(x) else good_encode(x), seed=2)
    with pytest.raises(AssertionError, match="0..255"):
        lab05.check_encode_e4m3(lambda x: good_encode(x) + 256, seed=2)


# --- per-channel INT8 --------------------------------------------------------------------------------------------
def good_quant(w, qmax=127, per="row", rnd=torch.round, absmax=True, in_float32=True):
    w = w.float() if in_float32 else w
    m = w.abs() if absmax else w
    amax = m.amax(dim=1, keepdim=True) if per == "row" else (m.amax().reshape(1, 1) if per == "tensor" else m.amax(0, keepdim=True))
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    return torch.clamp(rnd(w / scale), -127, 127).to(torch.int8), scale


def good_dequant(q, scale):
    return q.float() * scale


def test_int8_checker_accepts_correct(capsys):
    lab05.check_int8_per_channel(lambda w: good_quant(w), good_dequant, seed=0)
    lab05.check_int8_per_channel(quantize_per_channel_int8, good_dequant)
    assert "check_int8_per_channel passed" in capsys.readouterr().out


@pytest.mark.parametrize("quant, dequant, message", [
    (lambda w: good_quant(w, per="tensor"), good_dequant, "per-tensor"),
    # per-tensor broadcast to [out, 1] (the right shape): named per-tensor, not "the largest value"
    (lambda w: (lambda q, s: (q, s.expand(w.shape[0], 1)))(*good_quant(w, per="tensor")), good_dequant,
     "same scale.*per-tensor"),
    (lambda w: (lambda q, s: (q, s.expand(w.shape[0], 1).clone()))(*good_quant(w, per="tensor", absmax=False)),
     good_dequant, "same scale.*per-tensor"),
    (lambda w: good_quant(w, per="col"), good_dequant, "per input column|shape"),
    (lambda w: good_quant(w, qmax=128), good_dequant, "divided by 128"),
    (lambda w: good_quant(w, rnd=torch.trunc), good_dequant, "round to nearest"),
    (lambda w: good_quant(w, absmax=False), good_dequant, "largest \\|value\\||scale of row"),
    (lambda w: (torch.round(w / (w.abs().amax(1, keepdim=True) / 127)).to(torch.int8), w.abs().amax(1, keepdim=True) / 127),
     good_dequant, "all zeros"),
    (lambda w: (good_quant(w)[0].float(), good_quant(w)[1]), good_dequant, "torch.int8"),
    (lambda w: good_quant(w)[0], good_dequant, "tuple"),
    (good_quant, lambda q, s: q.float() / s, "dequantize: element"),
    (good_quant, lambda q, s: q.double() * s, "float32"),
    (good_quant, lambda q, s: (q.float() * s).flatten(), "shape"),
])
def test_int8_checker_names_each_mistake(quant, dequant, message):
    with pytest.raises(AssertionError, match=message) as err:
        lab05.check_int8_per_channel(quant, dequant, seed=3)
    named = ("quant.quantize_per_channel_int8 (lab 05, my_engine/quant.py): " if dequant is good_dequant else
             "dequantize_int8 (lab 05, an exercise kept in the notebook: not an engine part): ")
    assert str(err.value).startswith(named), str(err.value)
    assert "bfloat16" not in str(err.value)  # the dtype causes stay silent on other mistakes


@pytest.mark.parametrize("quant, message", [
    (lambda w: good_quant(w, in_float32=False), "for bfloat16 weights .* your scale is torch.bfloat16"),
    (lambda w: (lambda q, s: (q, s.double()))(*good_quant(w)), "scale has dtype torch.float64; the contract says "
                                                                "float32"),
    (lambda w: (lambda q, s: (q, s.half()))(*good_quant(w)), "scale has dtype torch.float16"),
    # float32 scales, but the quotient w / scale taken in bfloat16
    (lambda w: (lambda q, s: (torch.clamp(torch.round(w / s.to(w.dtype)), -127, 127).to(torch.int8), s))(
        *good_quant(w)), "divide in float32|scale"),
])
def test_int8_checker_checks_the_dtypes_a_quantizer_returns(quant, message):
    with pytest.raises(AssertionError, match=message) as err:
        lab05.check_int8_per_channel(quant, good_dequant, seed=3)
    assert str(err.value).startswith("quant.quantize_per_channel_int8 (lab 05, my_engine/quant.py): ")


# --- per-group INT4 ------------------------------------------------------------------------------------------------
def int4(w, gs, div=7, rounding="up", scale_for_q="stored", per="group", rnd=torch.round, zero_guard=True):
    g = w.float().reshape(w.shape[0], -1, gs)
    amax = g.abs().amax(-1, keepdim=True) if per == "group" else w.abs().amax(1, keepdim=True)[:, :, None].expand(
        -1, g.shape[1], 1)
    s32 = torch.where(amax > 0, amax / div, torch.ones_like(amax)) if zero_guard else amax / div
    s16 = s32.half()
    if rounding == "up":
        s16 = torch.where(s16.float() < s32, torch.nextafter(s16, torch.full_like(s16, math.inf)), s16)
    s_q = s16.float() if scale_for_q == "stored" else s32
    q = torch.clamp(rnd(g / s_q), -7, 7).nan_to_num().to(torch.int8)
    return q.reshape(w.shape), s16.squeeze(-1)


def dequant4(q, s, gs):  # an independent solution: each column's own scale
    return q.to(s.dtype) * s.repeat_interleave(gs, dim=1)


def test_int4_checker_accepts_correct(capsys):
    lab05.check_int4_per_group(int4, dequant4, seed=0)
    lab05.check_int4_per_group(quantize_per_group_int4, dequantize_int4)
    assert "check_int4_per_group passed" in capsys.readouterr().out
    assert learner_parts.load_part("quant.dequantize_int4") is dequantize_int4


@pytest.mark.parametrize("quant, dequant, message", [
    (lambda w, gs: int4(w, gs, rounding="nearest"), dequant4, "round the scale up"),
    (lambda w, gs: int4(w, gs, scale_for_q="fp32"), dequant4, "the scale you store"),
    (lambda w, gs: int4(w, gs, div=8), dequant4, "divide max\\|group\\| by 7"),
    (lambda w, gs: int4(w, gs, per="row"), dequant4, "row's largest"),
    (lambda w, gs: int4(w, gs, rnd=torch.trunc), dequant4, "round to nearest"),
    (lambda w, gs: int4(w, gs, zero_guard=False), dequant4, "all-zero group"),
    (lambda w, gs: (int4(w, gs)[0], int4(w, gs)[1].float()), dequant4, "fp16"),
    (lambda w, gs: (int4(w, gs)[0], int4(w, gs)[1][:, :1]), dequant4, "per-group means"),
    (lambda w, gs: (int4(w, gs)[0].float(), int4(w, gs)[1]), dequant4, "torch.int8"),
    (int4, lambda q, s, gs: q.to(s.dtype) * s.repeat(1, gs), "group j // group_size"),
    (int4, lambda q, s, gs: q.to(s.dtype), "w_hat"),
])
def test_int4_checker_names_each_mistake(quant, dequant, message):
    with pytest.raises(AssertionError, match=message) as err:
        lab05.check_int4_per_group(quant, dequant, seed=4)
    assert str(err.value).startswith("quant.quantize_per_group_int4 and quant.dequantize_int4 (lab 05, "
                                     "my_engine/quant.py): ")
    assert "return the scale's dtype" not in str(err.value)


@pytest.mark.parametrize("dequant", [
    lambda q, s, gs: q.float() * s.float().repeat_interleave(gs, dim=1),   # always float32
    lambda q, s, gs: (q.to(s.dtype) * s.repeat_interleave(gs, dim=1)).double(),
])
def test_int4_checker_checks_the_dtype_dequantize_returns(dequant):
    with pytest.raises(AssertionError, match="return the scale's dtype"):
        lab05.check_int4_per_group(int4, dequant, seed=4)


# --- the FP8 KV codec ----------------------------------------------------------------------------------------------
def decode_by_hand(bits, dtype, subnormals=True, sign=True):
    b = bits.to(torch.int32)
    s, e, m = b >> 7, (b >> 3) & 0xF, (b & 7).float()
    normal = (8 + m) * torch.exp2(e.float() - 10)
    v = torch.where(e == 0, m * 2.0 ** -9, normal) if subnormals else normal
    return torch.where((s == 1) & sign, -v, v).to(dtype)


def test_fp8_checker_accepts_correct(capsys):
    lab05.check_fp8_kv(fp8_encode, decode_by_hand, seed=0)
    assert "check_fp8_kv passed" in capsys.readouterr().out
    # without the clamp: right where torch's cast saturates (2.13), named where it overflows to NaN (2.11)
    no_clamp = lambda x: x.to(torch.float8_e4m3fn).view(torch.uint8)  # noqa: E731
    if no_clamp(torch.tensor([1000.0])).item() == 0x7E:
        lab05.check_fp8_kv(no_clamp, fp8_decode)
    else:
        with pytest.raises(AssertionError, match="saturate"):
            lab05.check_fp8_kv(no_clamp, fp8_decode)


@pytest.mark.parametrize("enc, dec, message", [
    (lambda x: x.clamp(-448, 448).to(torch.float8_e4m3fn), fp8_decode, "view\\(torch.uint8\\)"),
    (lambda x: x.clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.uint8), fp8_decode, "converted the values"),
    (lambda x: fp8_encode(x)[..., :-1], fp8_decode, "one byte per value"),
    (fp8_encode, lambda b, d: b.to(d), "byte values 0..255"),
    (fp8_encode, lambda b, d: decode_by_hand(b, d, subnormals=False), "subnormal"),
    (fp8_encode, lambda b, d: decode_by_hand(b, d, sign=False), "sign"),
    (fp8_encode, lambda b, d: decode_by_hand(b, torch.float32), "dtype asked for"),
])
def test_fp8_checker_names_each_mistake(enc, dec, message):
    with pytest.raises(AssertionError, match=message):
        lab05.check_fp8_kv(enc, dec, seed=5)


# --- the real engine with the learner's quantizers and codec ------------------------------------------------------
REFERENCE_PARTS = {"quant.quantize_per_channel_int8": quantize_per_channel_int8,
                   "quant.quantize_per_group_int4": quantize_per_group_int4, "quant.dequantize_int4": dequant4,
                   "kv_cache.fp8_encode": fp8_encode, "kv_cache.fp8_decode": decode_by_hand}


def test_quant_in_engine_accepts_correct_parts():
    summary = lab05.check_quant_in_engine(EngineParts(REFERENCE_PARTS), num_requests=4)
    assert set(summary["yours"]) == set(REFERENCE_PARTS) and all(n > 0 for n in summary["tokens"].values())


@pytest.mark.parametrize("name, wrong", [
    ("kv_cache.fp8_decode", lambda b, d: decode_by_hand(b, d, sign=False)),  # negative K/V read as positive
    ("quant.quantize_per_group_int4", lambda w, gs: int4(w, gs, per="row")),          # a coarser grid
    ("quant.quantize_per_channel_int8", lambda w: (lambda q, s: (q, s * 1.01))(*quantize_per_channel_int8(w))),
])
def test_quant_in_engine_catches_a_wrong_part(name, wrong):
    with pytest.raises(AssertionError, match="other tokens"):
        lab05.check_quant_in_engine(EngineParts({**REFERENCE_PARTS, name: wrong}), num_requests=4)


def test_a_quantizer_of_the_wrong_shape_is_named_by_the_engine():
    with pytest.raises(AssertionError, match="could not use your parts.*INT8 quantizer"):
        lab05.check_quant_in_engine(EngineParts({"quant.quantize_per_channel_int8": lambda w: (
            quantize_per_channel_int8(w)[0], quantize_per_channel_int8(w)[1].flatten()[:1])}), num_requests=2)


# --- the FP8 codec's rejections name both parts, their file and a cause --------------------------------------------
def _encode_without_sign(x):
    return fp8_encode(x.abs())


def _encode_flushing_subnormals(x):
    return fp8_encode(torch.where(x.abs() < 2.0 ** -6, torch.zeros_like(x), x))


def _encode_scaled(x):  # values nudged before rounding: bytes one E4M3 step (or more) off
    return fp8_encode(x * 0.97)


@pytest.mark.parametrize("encode, message", [
    (_encode_without_sign, "bit 7 is the sign"),
    (_encode_flushing_subnormals, "subnormal"),
    (_encode_scaled, "one step off|the byte is sign"),
])
def test_fp8_encode_rejections_name_the_parts_their_file_and_a_cause(encode, message):
    with pytest.raises(AssertionError, match=message) as err:
        lab05.check_fp8_kv(encode, fp8_decode, seed=0)
    assert str(err.value).startswith("kv_cache.fp8_encode and kv_cache.fp8_decode (lab 05, my_engine/kv_cache.py): ")
    assert "hint: " in str(err.value)


@pytest.mark.parametrize("decode, message", [
    (lambda b, dt: decode_by_hand(b, dt, subnormals=False), "subnormal"),
    (lambda b, dt: decode_by_hand(b, dt, sign=False), "sign"),
])
def test_fp8_decode_rejections_name_the_parts_their_file_and_a_cause(decode, message):
    with pytest.raises(AssertionError, match=message) as err:
        lab05.check_fp8_kv(fp8_encode, decode, seed=0)
    assert str(err.value).startswith("kv_cache.fp8_encode and kv_cache.fp8_decode (lab 05, my_engine/kv_cache.py): ")
