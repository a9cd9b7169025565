"""Negative controls for lab 05's claims: a good run passes, each perturbed measurement fails its claim."""
from __future__ import annotations

import copy

import pytest

from lab_utils.checks import lab05


def good() -> dict:
    ppl = {"fp32": 50.16, "int8 per-tensor": 53.54, "int8 per-channel": 50.21, "int8 per-channel A:int8": 124.0,
           "int4 per-channel": 104.5, "int4 g64": 73.99, "int4 g32": 64.91, "QAT int4 g64": 52.96,
           "GPTQ int4 g64": 67.31}
    return dict(ppl=ppl, fp32_ppl=50.16, qat_label="int4 g64", qat_losses=[0.9, 0.8, 0.5, 0.4], qat_steps=40,
                stored_int8_ppl=50.21, saved8=0.749, saved4=0.867, int8_share=0.41, int4_share=0.32,
                kv_ppl={"fp32": 50.16, "fp16": 50.16, "fp8_e4m3": 51.08, "fp8_e5m2": 51.85, "int8": 50.22},
                kv_tokens={"fp32": 23301, "fp16": 46603, "bf16": 46603, "fp8_e4m3": 93206, "int8": 90382},
                kv_budget_gib=1.0, engine_parts={n: True for n in lab05.QUANT_PARTS})


def test_a_good_run_passes(capsys):
    lab05.assert_claims(good())
    assert "FAIL" not in capsys.readouterr().out


def test_without_gptq_its_claim_is_left_out():
    r = good()
    del r["ppl"]["GPTQ int4 g64"]
    assert not any("GPTQ" in text for text, _ in lab05.claims(r))
    lab05.assert_claims(r, show=False)


def perturbed(section: str, key, value) -> dict:
    r = copy.deepcopy(good())
    if key is None:
        r[section] = value
    else:
        r[section][key] = value
    return r


@pytest.mark.parametrize("section, key, value, message", [
    ("ppl", "int8 per-channel", 54.0, "INT8 per-channel weights"),         # a broken per-channel scale
    ("ppl", "int8 per-tensor", 50.0, "per-channel beats per-tensor"),
    ("ppl", "int4 g32", 80.0, "finer INT4 groups"),
    ("ppl", "int8 per-channel A:int8", 50.0, "activations cost more"),
    ("ppl", "QAT int4 g64", 75.0, "QAT beats PTQ"),
    ("qat_losses", None, [0.5, 0.4, 0.9, 0.8], "loss falls"),                # training that diverges
    ("ppl", "GPTQ int4 g64", 80.0, "GPTQ beats"),
    ("stored_int8_ppl", None, 51.0, "stored INT8 model"),                   # a stored layer that differs
    ("saved8", None, 0.5, "stored INT8 saves"),                             # a stored copy kept in FP32
    ("kv_ppl", "fp8_e4m3", 60.0, "FP8 E4M3 KV cache: perplexity"),
    ("kv_ppl", "int8", 52.0, "per-vector INT8 KV"),
    ("kv_tokens", "fp8_e4m3", 46603, "check of the model"),                 # a budget counted in 2-byte values
    ("engine_parts", "kv_cache.fp8_decode", False, "the engine ran your parts"),  # the engine's own codec ran
    ("engine_parts", None, {}, "the engine ran your parts"),
])
def test_each_claim_fails_on_a_wrong_measurement(section, key, value, message):
    with pytest.raises(AssertionError, match=message):
        lab05.assert_claims(perturbed(section, key, value), show=False)
