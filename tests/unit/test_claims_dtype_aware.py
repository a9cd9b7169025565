"""Claims whose expectation comes from the device, the model's dtype and measured costs, not a CPU fp32 constant
(lab 00's token identity and KV-cache speed-up). Each can fail: negative controls below."""
from __future__ import annotations

import pytest
import torch

from lab_utils.checks import lab00
from lab_utils.models.loader import load_model


def test_predicted_kv_speedup_from_measured_costs():
    # a CPU: a 64-token forward costs 8x a decode step -> caching pays several-fold
    cpu = lab00.predicted_kv_speedup({16: 0.01, 64: 0.04, 128: 0.08}, 0.005, 64, 12)
    assert 5 < cpu < 9
    # a launch-bound GPU: a forward of ~70 tokens costs what a 1-token step costs -> about 1x
    gpu = lab00.predicted_kv_speedup({16: 0.004, 64: 0.0041, 128: 0.0043, 1024: 0.006}, 0.004, 64, 12)
    assert 0.95 < gpu < 1.1


def _claims(**over):
    toks = torch.arange(10)[None]
    r = dict(naive_tokens=toks, cached_tokens=toks.clone(), kv_speedup=4.3, t_max=128, prefill_tps=640.0,
             decode_tps={1: 100.0, 16: 900.0}, ai_decode=1.0, ai_prefill=100.0, ridge=10.0, prefill_vs_peak=0.5,
             decode_vs_peak=0.01, seq=dict(median_ttft_ms=50, output_throughput=10, request_goodput=1),
             bat=dict(median_ttft_ms=30, output_throughput=20, request_goodput=2))
    r.update(over)
    return dict(lab00.claims(r))


def _claim(cl: dict, start: str) -> bool:
    return next(ok for text, ok in cl.items() if text.startswith(start))


def test_kv_claim_follows_the_prediction():
    # GPU-like: predicted 1.05x, measured 1.0x: passes (the CPU constant 1.5x would have failed it)
    assert _claim(_claims(kv_speedup=1.0, kv_predicted=1.05), "KV cache speeds up")
    assert not _claim(_claims(kv_speedup=1.0), "KV cache speeds up")  # no prediction: the CPU constant
    # negative controls: far below the prediction, or below 1.5x where a prefill costs far more than a step
    assert not _claim(_claims(kv_speedup=0.5, kv_predicted=1.05), "KV cache speeds up")
    assert not _claim(_claims(kv_speedup=1.4, kv_predicted=2.6), "KV cache speeds up")
    assert _claim(_claims(kv_speedup=4.0, kv_predicted=6.0), "KV cache speeds up")


def test_token_claim_accepts_a_near_tie_only():
    a, b = torch.arange(10)[None], torch.arange(10)[None].clone()
    b[0, 7] = 99
    assert _claim(_claims(naive_tokens=a, cached_tokens=b, tie=(0.01, 0.05), dtype="torch.bfloat16"), "naive and")
    assert not _claim(_claims(naive_tokens=a, cached_tokens=b, tie=(0.5, 0.05)), "naive and")
    assert not _claim(_claims(naive_tokens=a, cached_tokens=b), "naive and")  # no tie measured: must be identical


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_agree_on_a_real_model(dtype):
    model, _ = load_model("tiny-random", device="cpu", dtype=dtype)
    ids = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)[0, -1].float()
    top2 = logits.topk(2).indices
    same = torch.cat([ids, top2[:1, None].T], 1)
    other = torch.cat([ids, top2[1:2, None].T], 1)
    assert lab00.tokens_agree(model, same, same.clone()) == (True, 0.0, 0.0)
    ok, gap, tol = lab00.tokens_agree(model, same, other)
    assert gap == pytest.approx(float(logits[top2[0]] - logits[top2[1]]), rel=1e-3, abs=1e-3)
    assert ok == (gap <= tol) and tol == pytest.approx(8 * torch.finfo(dtype).eps * float(logits.abs().max()))
    worst = torch.cat([ids, logits.argmin()[None, None]], 1)  # the least likely token: never a near-tie
    assert not lab00.tokens_agree(model, same, worst)[0]
