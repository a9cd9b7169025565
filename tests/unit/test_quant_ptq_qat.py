"""PTQ (RTN, GPTQ, static activation scales), QAT with a straight-through estimator, perplexity, KV precision."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lab_utils.models.llama import dense_causal_attention
from lab_utils.quant.formats import FP8_E4M3, fake_quant_int
from lab_utils.quant.kv import (
    kv_bytes_per_token,
    kv_quant_attention,
    quantize_kv,
    tokens_in_budget,
)
from lab_utils.quant.quantize import (
    HELDOUT_PLAY,
    FakeQuantLinear,
    QuantConfig,
    StaticQuantLinear,
    corpus_tokens,
    fake_quant_weight,
    gptq_quantize,
    kd_loss,
    perplexity,
    ptq,
    qat,
    shakespeare_plays,
    windows,
)


@pytest.fixture(scope="module")
def tiny():
    from lab_utils import load_model

    return load_model("tiny-random", device="cpu", dtype=torch.float32)


def test_config_validation_and_labels():
    assert QuantConfig("int4", "group", 64).label == "int4 g64" and QuantConfig(None).label == "fp32"
    assert QuantConfig("int8", activation="int8").label == "int8 per-channel A:int8"
    assert QuantConfig("fp8_e4m3").weight_bits == 8 and QuantConfig("int3").weight_bits == 3
    for bad in (QuantConfig("int1"), QuantConfig("fp6"), QuantConfig("int8", "row"), QuantConfig("int8", activation="int4")):
        with pytest.raises(ValueError):
            bad.validate()


def test_fake_quant_weight_per_format():
    w = torch.randn(16, 64) * 0.05
    assert torch.equal(fake_quant_weight(w, QuantConfig("int4", "group", 16)), fake_quant_int(w, 4, True, "group", 16))
    assert torch.equal(fake_quant_weight(w, QuantConfig("bf16")), w.bfloat16().float())
    fp8 = fake_quant_weight(w, QuantConfig("fp8_e4m3", "channel"))
    ratio = fp8 / (w.abs().amax(1, keepdim=True) / FP8_E4M3.max_value)  # each row scaled to E4M3's range
    assert torch.allclose(ratio, FP8_E4M3.round_tensor(ratio).float(), atol=1e-4)
    assert torch.equal(fake_quant_weight(w, QuantConfig(None)), w)


def test_perplexity_is_exp_of_mean_cross_entropy(tiny):
    model, _ = tiny
    ids = torch.randint(0, 1000, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert perplexity(model, ids, batch_size=2) == pytest.approx(math.exp(float(ce)), rel=1e-5)
    with pytest.raises(ValueError, match="windows"):
        windows(torch.arange(10), 4, 3)


def test_ptq_copies_and_quantizes_every_linear_but_lm_head(tiny):
    model, _ = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = ptq(model, QuantConfig("int4", "group", 32))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()), "ptq changed the original"
    w, wq = model.model.layers[1].mlp.down_proj.weight, q.model.layers[1].mlp.down_proj.weight
    assert torch.equal(wq, fake_quant_int(w, 4, True, "group", 32))
    assert torch.equal(q.lm_head.weight, model.lm_head.weight) and q.lm_head.weight is q.model.embed_tokens.weight
    with pytest.raises(ValueError, match="calib"):
        ptq(model, QuantConfig("int4"), method="gptq")


def test_static_activation_quantization_is_calibrated(tiny):
    model, _ = tiny
    calib = torch.randint(0, 2000, (2, 16), generator=torch.Generator().manual_seed(1))
    q = ptq(model, QuantConfig("int8", activation="int8"), calib=calib)
    layers = [m for m in q.modules() if isinstance(m, StaticQuantLinear)]
    assert len(layers) == 14 and all(float(m.act_scale) > 0 for m in layers)
    with torch.no_grad():
        ref, out = model(calib), q(calib)
    assert (out - ref).abs().max() < 0.1 * ref.abs().max()


def test_gptq_beats_round_to_nearest_on_correlated_inputs():
    g = torch.Generator().manual_seed(2)
    n_in, n_out = 64, 32
    mix = torch.randn(n_in, n_in, generator=g) / 8 + torch.eye(n_in)
    X = torch.randn(2048, n_in, generator=g) @ mix * torch.exp(torch.randn(n_in, generator=g))  # correlated, uneven
    W = torch.randn(n_out, n_in, generator=g) * 0.1
    for cfg in (QuantConfig("int4", "channel"), QuantConfig("int3", "group", 16), QuantConfig("int4", "group", 16, False)):
        rtn = fake_quant_weight(W, cfg)
        gq = gptq_quantize(W, X.T @ X, cfg)
        err = lambda Q: float(((X @ (W - Q).T) ** 2).mean())
        assert err(gq) < 0.8 * err(rtn), f"{cfg.label}: GPTQ {err(gq):.3g} vs RTN {err(rtn):.3g}"
        if cfg.granularity == "channel":  # GPTQ's values sit on the RTN grid of the same scale
            s = W.abs().amax(1, keepdim=True) / 7
            assert torch.allclose(gq / s, torch.round(gq / s), atol=1e-4) and (gq / s).abs().max() <= 7 + 1e-4


def test_qat_loss_falls_and_beats_ptq_on_training_batches(tiny):
    model = copy.deepcopy(tiny[0])
    with torch.no_grad():  # std 0.02 -> 0.08: a random model with non-trivial predictions to distil
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(4)
    train = torch.randint(0, 3000, (8, 24), generator=torch.Generator().manual_seed(3))
    cfg = QuantConfig("int2", "channel")  # coarse enough that rounding error dominates
    res = qat(model, cfg, train, steps=30, lr=1e-3, batch_size=4, seed=0)
    first, last = sum(res.losses[:5]) / 5, sum(res.losses[-5:]) / 5
    assert last < 0.7 * first, f"QAT loss did not fall: {first:.4f} -> {last:.4f}"
    rtn = ptq(model, cfg)
    assert kd_loss(res.model, model, train) < 0.6 * kd_loss(rtn, model, train)
    assert not any(isinstance(m, FakeQuantLinear) for m in res.model.modules())
    w = res.model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(w, fake_quant_int(w, 2, True, "channel")), "QAT output is not on the quantization grid"
    assert not any(p.requires_grad for p in res.model.parameters())


def test_qat_of_the_last_layers_leaves_the_others_as_ptq_quantizes_them(tiny):
    """SMOKE's short QAT trains the last layers only; the rest must equal PTQ's, so the comparison stays fair."""
    model = tiny[0]
    last = len(model.model.layers) - 1
    train = torch.randint(0, 3000, (4, 16), generator=torch.Generator().manual_seed(1))
    cfg = QuantConfig("int4", "group", 16)
    res = qat(model, cfg, train, steps=3, lr=1e-2, batch_size=2, seed=0, train_layers=1)
    rtn = ptq(model, cfg)
    for name, lin in rtn.named_modules():
        if isinstance(lin, nn.Linear) and "lm_head" not in name:
            same = torch.equal(lin.weight, res.model.get_submodule(name).weight)
            assert same == (f"layers.{last}." not in name), name  # trained: moved; frozen: PTQ's exactly
    with pytest.raises(ValueError, match="train_layers"):
        qat(model, cfg, train, steps=1, train_layers=0)


def test_fake_quant_linear_passes_gradients_straight_through():
    lin = nn.Linear(8, 4, bias=False)
    fq = FakeQuantLinear(lin, QuantConfig("int2", "channel"))
    x = torch.randn(3, 8)
    fq(x).sum().backward()
    assert torch.allclose(lin.weight.grad, torch.ones(3, 4).T @ x)  # d/dW of sum(x Wᵀ), rounding ignored
    with torch.no_grad():
        assert torch.allclose(fq(x), x @ fake_quant_int(lin.weight, 2, True, "channel").T)


def test_shakespeare_split_holds_out_one_play():
    plays = shakespeare_plays()
    assert HELDOUT_PLAY in plays and len(plays) > 30 and "**" not in plays[HELDOUT_PLAY]

    class CharTok:  # a stand-in tokenizer: one id per character
        def __call__(self, text):
            return {"input_ids": [ord(c) % 1000 for c in text]}

    held, train = corpus_tokens(CharTok(), "heldout"), corpus_tokens(CharTok(), "train", max_tokens=5000)
    assert held.numel() > 10_000 and train.numel() == 5000
    assert plays[HELDOUT_PLAY][:200] not in "\n\n".join(t for n, t in plays.items() if n != HELDOUT_PLAY)


def test_kv_cache_bytes_for_smollm2_shape():
    from lab_utils.models.llama import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    assert kv_bytes_per_token(cfg, "fp32") == 30 * 2 * 3 * 64 * 4 == 46080
    assert kv_bytes_per_token(cfg, "fp8") == 11520 and kv_bytes_per_token(cfg, "fp16") == 23040
    assert kv_bytes_per_token(cfg, "int8") == 11520 + 30 * 2 * 3 * 4 == 12240  # one fp32 scale per head vector
    assert tokens_in_budget(cfg, 2**30, "fp8_e4m3") // 4 == tokens_in_budget(cfg, 2**30, "fp32") == 2**30 // 46080
    with pytest.raises(ValueError, match="kv cache dtype 'int4'"):
        kv_bytes_per_token(cfg, "int4")


def test_kv_quant_attention_is_close_to_dense():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 10, h, 16, generator=g) for h in (4, 2, 2))
    ref = dense_causal_attention(0, q, k, v)
    errs = {kind: float((kv_quant_attention(kind)(0, q, k, v) - ref).abs().max()) for kind in ("fp16", "int8", "fp8_e4m3", "fp8_e5m2")}
    assert errs["fp16"] < 1e-3 and errs["int8"] < 0.05 and errs["fp8_e4m3"] < 0.15 and errs["fp8_e5m2"] < 0.3
    assert errs["fp16"] < errs["int8"] < errs["fp8_e4m3"] < errs["fp8_e5m2"]
    k_int8 = quantize_kv(k, "int8")
    assert ((k_int8 - k).abs() <= k.abs().amax(-1, keepdim=True) / 127 / 2 * 1.01 + 1e-6).all()
    assert float(quantize_kv(torch.tensor([1000.0]), "fp8").item()) == 448.0  # saturates
