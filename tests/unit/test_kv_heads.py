"""Tensor parallelism's head placement, by vLLM's rules: which TP sizes vLLM refuses, how many KV heads a rank
holds, and the KV capacity that counts replicated KV heads, checked against a rank-by-rank count."""
from __future__ import annotations

import json

import pytest
import torch

from lab_utils.parallel import vllm_side
from lab_utils.parallel.kv_heads import (
    check_vllm_tp,
    kv_capacity_tokens,
    kv_heads_per_rank,
    kv_replication,
    vllm_tp_refusal,
)
from lab_utils.sim import gpu, kv_capacity, model_spec


def test_vllm_refuses_smollm2_at_tp2_and_accepts_the_1b_shape():
    smol, one_b = model_spec("smollm2-135m"), model_spec(vllm_side.VLLM_TP_MODEL)
    why = vllm_tp_refusal(smol.num_heads, smol.num_kv_heads, 2)
    assert why is not None and "9 heads" in why
    assert vllm_tp_refusal(one_b.num_heads, one_b.num_kv_heads, 2) is None
    assert vllm_tp_refusal(32, 8, 16) is None  # 16 ranks, 8 KV heads: each replicated twice
    assert "neither" in vllm_tp_refusal(24, 8, 12)  # 12 divides 24 query heads, but neither 8 | 12 nor 12 | 8
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .*9 heads.*\[1, 3, 9\]"):
        check_vllm_tp(9, 3, 2, "smollm2-135m")
    with pytest.raises(ValueError, match="tp=0"):
        vllm_tp_refusal(9, 3, 0)


def test_kv_heads_per_rank_even_replicated_and_uneven():
    assert [kv_heads_per_rank(8, tp) for tp in (1, 2, 4, 8, 16, 32)] == [8, 4, 2, 1, 1, 1]
    assert kv_heads_per_rank(3, 2) == 2  # the course's uneven split: 2 + 1
    assert [kv_replication(8, tp) for tp in (2, 8, 16, 32)] == [1.0, 1.0, 2.0, 4.0]


def _rank_by_rank(weight_bytes, kv_bytes_per_token, mem, tp, util, kv_heads):
    """Each rank's own count: its memory minus its share of the weights, over the KV bytes of the heads it keeps
    (an even split, or whole heads replicated, or the course's uneven split); the group holds what its fullest
    rank holds."""
    per_head = kv_bytes_per_token / kv_heads
    if tp <= kv_heads:
        heads = [kv_heads // tp + (1 if r < kv_heads % tp else 0) for r in range(tp)]
    else:
        heads = [1] * tp
    free_per_rank = mem * util - weight_bytes / tp
    return max(0, min(int(free_per_rank // (per_head * h)) for h in heads)) if free_per_rank > 0 else 0


@pytest.mark.parametrize("kv_heads", [1, 2, 3, 8])
@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_capacity_is_what_the_fullest_rank_holds(kv_heads, tp):
    w, mem, util = 40e9, 80e9, 0.9
    per_token = 2 * 32 * kv_heads * 128 * 2
    got = kv_capacity_tokens(w, per_token, mem, tp, util, kv_heads)
    assert abs(got - _rank_by_rank(w, per_token, mem, tp, util, kv_heads)) <= 1  # floor per rank vs in total


def test_replication_halves_what_the_plain_formula_promises():
    """Llama-3-70B (8 KV heads) on 16 H100s: every rank keeps a whole KV head, so the group stores each token's
    KV twice; the plain (TP·M·u − W) / bytes formula counts double. At TP <= 8 both agree."""
    m, h100 = model_spec("llama-3-70b", "fp16"), gpu("H100")
    plain = lambda n: int((n * h100.mem_bytes * 0.9 - m.weight_bytes) // m.kv_bytes_per_token)  # noqa: E731
    for n in (2, 4, 8):
        assert kv_capacity(m, h100, n)["kv_tokens"] == plain(n)
        assert kv_capacity_tokens(m.weight_bytes, m.kv_bytes_per_token, h100.mem_bytes, n, 0.9, 8) == plain(n)
    cap16 = kv_capacity(m, h100, 16)
    assert cap16["kv_replication"] == 2.0
    assert abs(cap16["kv_tokens"] - plain(16) / 2) <= 1
    # pipeline stages add memory but split layers, not heads: 8-way TP x 2 stages replicates nothing
    assert kv_capacity(m, h100, 16, tp=8)["kv_tokens"] == plain(16)


def test_capacity_rejects_bad_input():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_capacity_tokens(1e9, 1000, 80e9, 2, 1.5, 8)
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        kv_capacity_tokens(1e9, 0, 80e9, 2, 0.9, 8)
    assert kv_capacity_tokens(200e9, 1000, 80e9, 2, 0.9, 8) == 0  # the weights do not fit


def test_random_weights_folder_holds_the_weights_load_model_draws(tmp_path):
    """vLLM loads the folder; here the course's loader does, and must find the very weights of the name."""
    from lab_utils.models.loader import load_model

    folder = vllm_side.random_weights_folder("tiny-random", tmp_path / "tiny", seed=3)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == 2
    assert (folder / "tokenizer.json").exists()
    drawn, _ = load_model("tiny-random", device="cpu", dtype=torch.float32, seed=3)
    loaded, tok = load_model(str(folder), device="cpu", dtype=torch.float32)
    for (name, a), (_, b) in zip(sorted(drawn.state_dict().items()), sorted(loaded.state_dict().items())):
        assert torch.equal(a, b), name
    other, _ = load_model("tiny-random", device="cpu", dtype=torch.float32, seed=4)
    assert not torch.equal(other.model.embed_tokens.weight, loaded.model.embed_tokens.weight)
    assert vllm_side.random_weights_folder("tiny-random", folder, seed=3) == folder  # a complete folder is kept
    vllm_side.check_folder_tp(folder, 2)
    with pytest.raises(ValueError, match="cannot run with tensor_parallel_size=3"):
        vllm_side.check_folder_tp(folder, 3)
    with pytest.raises(ValueError, match="not a registered random-weight model"):
        vllm_side.random_weights_folder("smollm2-135m", tmp_path / "x")
