"""Lab 05's checkers accept correct solutions and reject each common mistake with a message that names it."""
from __future__ import annotations

import math

import pytest
import torch

from lab_utils.checks import lab05
from lab_utils.quant.formats import FP8_E4M3


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
def good_quant(w, qmax=127, per="row", rnd=torch.round, absmax=True):
    m = w.abs() if absmax else w
    amax = m.amax(dim=1, keepdim=True) if per == "row" else (m.amax().reshape(1, 1) if per == "tensor" else m.amax(0, keepdim=True))
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    return torch.clamp(rnd(w / scale), -127, 127).to(torch.int8), scale


def good_dequant(q, scale):
    return q.float() * scale


def test_int8_checker_accepts_correct(capsys):
    lab05.check_int8_per_channel(good_quant, good_dequant, seed=0)
    lab05.check_int8_per_channel(good_quant, good_dequant)
    assert "check_int8_per_channel passed" in capsys.readouterr().out


@pytest.mark.parametrize("quant, dequant, message", [
    (lambda w: good_quant(w, per="tensor"), good_dequant, "per-tensor"),
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
    with pytest.raises(AssertionError, match=message):
        lab05.check_int8_per_channel(quant, dequant, seed=3)
