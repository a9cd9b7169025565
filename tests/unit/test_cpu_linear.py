"""oneDNN-packed linears (the engine's CPU GEMM): same results as F.linear, the caller's model untouched."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lab_utils import EngineConfig, LLMEngine, SamplingParams, load_model
from lab_utils.engine.accel.cpu_fused import (
    FusedLlamaDecoderLayer,
    FusedLlamaForCausalLM,
    FusedPackedLinear,
    fusable,
)
from lab_utils.engine.accel.cpu_linear import PackedLinear, packed_linear_available
from lab_utils.engine.accel.cpu_view import fast_linears, pack_linears
from lab_utils.models.llama import LlamaForCausalLM
from lab_utils.quant.linear import quantize_model

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn)")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (3, 7, 64), (33, 64)])
def test_packed_linear_equals_f_linear(bias, shape):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        got = PackedLinear(lin)(x)
    torch.testing.assert_close(got, nn.functional.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert got.shape == (*shape[:-1], 96)


@needs_onednn
def test_training_takes_the_plain_path():
    lin = nn.Linear(8, 4)
    packed = PackedLinear(lin)
    x = torch.randn(2, 8, requires_grad=True)
    packed(x).sum().backward()  # gradients flow through F.linear
    assert lin.weight.grad is not None and x.grad is not None


@needs_onednn
def test_pack_linears_shares_parameters_and_leaves_the_model_alone():
    model, _ = load_model("tiny-random", device="cpu", dtype=torch.float32)
    view, count = pack_linears(model)
    assert count == 7 * model.config.num_hidden_layers + 1  # q k v o gate up down per layer, lm head
    assert all(type(m) is not PackedLinear for m in model.modules()), "the caller's model must not change"
    assert view.lm_head.weight is model.lm_head.weight  # shared (tied to the embedding), not copied
    assert view.model.embed_tokens.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    with torch.inference_mode():
        torch.testing.assert_close(view(ids), model(ids), rtol=1e-4, atol=1e-4)


def test_fast_linears_is_cpu_float32_only(monkeypatch):
    model, _ = load_model("tiny-random", device="cpu", dtype=torch.float32)
    assert packed_linear_available(torch.device("cpu"), torch.float32) == torch.backends.mkldnn.is_available()
    assert not packed_linear_available(torch.device("cpu"), torch.bfloat16)
    assert not packed_linear_available(torch.device("cuda"), torch.float32)
    monkeypatch.setenv("LAB_CPU_PACKED_LINEAR", "0")
    assert fast_linears(model, torch.device("cpu")) is model


@needs_onednn
def test_engine_scores_tokens_alike_with_and_without_packing(monkeypatch):
    """Teacher-forced (oneDNN's packed GEMM and F.linear sum in other orders): the plain engine scores the
    packed engine's greedy tokens with the same logits to float round-off."""
    from lab_utils.checks.teacher_forced import assert_same_up_to_rounding, engine_logits_batch

    model, tok = load_model("tiny-random", device="cpu", dtype=torch.float32)
    prompts = [[5 + i, 17, 99, 3 * i + 1][: 2 + i % 3] for i in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def run(tokens=None):
        eng = LLMEngine((model, tok), EngineConfig(max_num_seqs=4, num_gpu_blocks=64), device="cpu")
        tokens = tokens or [o.token_ids for o in eng.generate(prompts, params)]
        logits = engine_logits_batch(eng, prompts, tokens)
        eng.block_manager.check_all_free()
        return eng, tokens, logits

    eng, tokens, packed = run()
    assert any(type(m) is PackedLinear for m in eng.runner.model.modules())
    monkeypatch.setenv("LAB_CPU_PACKED_LINEAR", "0")
    eng, _, plain = run(tokens)
    assert eng.runner.model is model
    assert_same_up_to_rounding(plain, packed, "oneDNN's packed linears")


@needs_onednn
def test_engines_on_one_model_share_the_packed_view_until_a_weight_changes():
    model, _ = load_model("tiny-random", device="cpu", dtype=torch.float32)
    cpu = torch.device("cpu")
    first = fast_linears(model, cpu)
    assert fast_linears(model, cpu) is first  # a second engine reuses it: no second copy of the weights
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(1.0)  # e.g. a lab trains or quantizes in place
    second = fast_linears(model, cpu)
    assert second is not first
    x = torch.randn(3, model.config.hidden_size)
    inter = model.config.intermediate_size
    with torch.inference_mode():  # the fused gate/up weight was packed again, from the changed weight
        torch.testing.assert_close(second.model.layers[0].gate_up(x)[:, inter:],
                                   nn.functional.linear(x, model.model.layers[0].mlp.up_proj.weight))


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 2048])  # 2048: past min_rows_for_mkl, the linears run one by one
def test_fused_packed_linear_equals_the_linears_side_by_side(rows):
    torch.manual_seed(0)
    linears = [nn.Linear(64, n, bias=False) for n in (96, 32, 32)]
    fused = FusedPackedLinear(linears)
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        got = fused(x)
    want = torch.cat([nn.functional.linear(x, lin.weight) for lin in linears], dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="bias-free"):
        FusedPackedLinear([nn.Linear(4, 4, bias=True)])
    x.requires_grad_(True)
    fused(x).sum().backward()  # training takes the plain linears: gradients reach the shared weights
    assert all(lin.weight.grad is not None for lin in linears)


@needs_onednn
def test_fused_view_computes_the_reference_model():
    model, _ = load_model("tiny-random", device="cpu", dtype=torch.float32)
    view, _ = pack_linears(model)
    assert type(view) is FusedLlamaForCausalLM and type(model) is LlamaForCausalLM
    assert all(type(layer) is FusedLlamaDecoderLayer for layer in view.model.layers)
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 9))
    pos = torch.arange(5, 14).expand(3, 9)  # positions given (the engine's and the KV caches' call)
    with torch.inference_mode():
        torch.testing.assert_close(view(ids), model(ids), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(view(ids, pos), model(ids, pos), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="batch, seq"):
        view.hidden_states(ids[0])  # the reference's input checks hold on the fast path too


@needs_onednn
def test_only_plain_float32_llama_models_are_fused():
    model, _ = load_model("tiny-random", device="cpu", dtype=torch.float32)
    assert fusable(model)
    assert type(pack_linears(model, fuse=False)[0]) is LlamaForCausalLM  # packed one by one only

    class Custom(LlamaForCausalLM):  # a subclass may change the layer maths: keep its forward
        pass

    custom = Custom(model.config)
    assert not fusable(custom) and type(pack_linears(custom)[0]) is Custom
    quantized, _ = load_model("tiny-random", device="cpu", dtype=torch.float32)
    quantize_model(quantized, "int4", group_size=32)  # INT4 projections (lab 05): those layers keep their forward
    assert not fusable(quantized)  # (weight-only INT8 ones are fused: tests/unit/test_small_m_linear.py)
    view, _ = pack_linears(quantized)
    ids = torch.randint(0, model.config.vocab_size, (1, 7))
    with torch.inference_mode():
        torch.testing.assert_close(view(ids), quantized(ids), rtol=1e-4, atol=1e-4)
    assert not fusable(load_model("tiny-random", device="cpu", dtype=torch.bfloat16)[0])


@needs_onednn
def test_fused_layers_switch_off_for_ab_measurements(monkeypatch):
    model, tok = load_model("tiny-random", device="cpu", dtype=torch.float32)
    cpu = torch.device("cpu")
    assert type(fast_linears(model, cpu)) is FusedLlamaForCausalLM
    monkeypatch.setenv("LAB_CPU_FUSED_LAYERS", "0")
    plain = fast_linears(model, cpu)
    assert type(plain) is LlamaForCausalLM and plain is not model  # still packed, one linear at a time
    assert type(plain.model.layers[0].self_attn.q_proj) is PackedLinear
    prompts, params = [[5, 17, 99], [3, 1]], SamplingParams(max_tokens=10, ignore_eos=True)
    unfused = [o.token_ids for o in LLMEngine((model, tok), EngineConfig(num_gpu_blocks=32), device="cpu")
               .generate(prompts, params)]
    monkeypatch.delenv("LAB_CPU_FUSED_LAYERS")
    eng = LLMEngine((model, tok), EngineConfig(num_gpu_blocks=32), device="cpu")
    assert type(eng.runner.model) is FusedLlamaForCausalLM
    assert [o.token_ids for o in eng.generate(prompts, params)] == unfused
