"""KV sizing on a GPU (vLLM's meaning of gpu_memory_utilization) and the engine's lifetime (freed by `del`)."""
import gc
import weakref

import pytest
import torch

from lab_utils import EngineConfig, LLMEngine
from lab_utils.engine.kv.kv_budget import GiB, DeviceMemory, kv_cache_budget, model_bytes
from lab_utils.models.loader import load_model

H200 = 139 * GiB
CONTEXT = GiB // 2  # CUDA context + allocator slack of one process
# bf16 weights of the course's shapes, and a profile run's peak activations
SMOLLM2_135M = dict(weights=int(134.5e6) * 2, activations=GiB // 4)
LLAMA_1B = dict(weights=int(1.236e9) * 2, activations=GiB)


def _card(used_by_others: int, weights: int, activations: int) -> DeviceMemory:
    return DeviceMemory(total=H200, free=H200 - used_by_others - CONTEXT - weights - activations,
                        weights=weights, activations=activations)


@pytest.mark.parametrize("shape", [SMOLLM2_135M, LLAMA_1B])
def test_kv_is_a_share_of_total_minus_what_the_instance_uses(shape):
    mem = _card(0, **shape)
    kv = kv_cache_budget(mem, 0.9)
    assert kv == int(H200 * 0.9) - shape["weights"] - shape["activations"]
    # the whole instance (weights + activations + KV) stays inside 90 % of the card; the old rule (90 % of free
    # memory for KV alone) went past it
    assert kv + shape["weights"] + shape["activations"] <= 0.9 * H200
    assert int(mem.free * 0.9) + shape["weights"] + shape["activations"] > 0.9 * H200 - GiB


def test_a_second_engine_on_the_same_card_gets_a_clear_error_naming_a_utilization_that_fits():
    first = kv_cache_budget(_card(0, **SMOLLM2_135M), 0.9)
    others = first + SMOLLM2_135M["weights"] + SMOLLM2_135M["activations"] + CONTEXT
    second = _card(others, **LLAMA_1B)
    with pytest.raises(ValueError, match="lower gpu_memory_utilization to at most 0.0"):
        kv_cache_budget(second, 0.9)


def test_two_engines_that_each_take_a_share_both_fit():
    first = kv_cache_budget(_card(0, **SMOLLM2_135M), 0.45)
    others = first + SMOLLM2_135M["weights"] + SMOLLM2_135M["activations"] + CONTEXT
    second = kv_cache_budget(_card(others, **LLAMA_1B), 0.45)
    assert first > 50 * GiB and second > 50 * GiB
    assert first + second + others - first + LLAMA_1B["weights"] + LLAMA_1B["activations"] <= H200


def test_a_share_smaller_than_the_weights_is_a_clear_error():
    with pytest.raises(ValueError, match="no room for a KV cache"):
        kv_cache_budget(_card(0, **LLAMA_1B), 0.01)
    with pytest.raises(ValueError, match="must be in"):
        kv_cache_budget(_card(0, **LLAMA_1B), 1.5)


def test_engine_on_cuda_sizes_the_pool_from_total_memory(monkeypatch):
    """The engine's CUDA branch, with the card's numbers mocked (an H200 with a 1 GiB-used neighbour)."""
    import lab_utils.engine.kv.kv_budget as kb

    model, tok = load_model("tiny-random", device="cpu", dtype=torch.float32)
    mem = DeviceMemory(total=H200, free=H200 - GiB, weights=model_bytes(model), activations=1 << 20)
    seen = {}

    def fake_measure(m, device, tokens, rows):
        seen.update(tokens=tokens, rows=rows)
        return mem

    monkeypatch.setattr(kb, "measure", fake_measure)
    eng = LLMEngine((model, tok), EngineConfig(num_gpu_blocks=8), device="cpu")
    eng.config = EngineConfig(gpu_memory_utilization=0.001, max_num_seqs=4)
    eng.device = torch.device("cuda")  # the sizing step alone, as on a GPU
    n = eng._num_blocks()
    assert n == kv_cache_budget(mem, 0.001) // eng.bytes_per_block
    assert seen == {"tokens": 512, "rows": 4}


def test_deleted_engine_is_freed_without_a_gc_pass():
    model, tok = load_model("tiny-random", device="cpu", dtype=torch.float32)
    eng = LLMEngine((model, tok), EngineConfig(num_gpu_blocks=32, preemption_mode="swap", max_num_seqs=2),
                    device="cpu")
    eng.generate([[1, 2, 3]] * 2)
    pool = weakref.ref(eng.kv_cache.k)
    ref = weakref.ref(eng)
    gc.disable()
    try:
        del eng
        assert ref() is None, "an engine in a reference cycle keeps its KV pool until a full gc pass"
        assert pool() is None
    finally:
        gc.enable()


def test_close_frees_the_pool_and_refuses_new_work():
    model, tok = load_model("tiny-random", device="cpu", dtype=torch.float32)
    with LLMEngine((model, tok), EngineConfig(num_gpu_blocks=32), device="cpu") as eng:
        eng.generate([[1, 2, 3]])
        pool = weakref.ref(eng.kv_cache.k)
    assert pool() is None and eng.closed
    with pytest.raises(RuntimeError, match="closed"):
        eng.add_request([1, 2])


def test_serve_cli_and_lab_server_take_a_gpu_memory_share():
    import argparse

    from lab_utils.engine.cli import add_engine_args, engine_config_from_args
    from lab_utils.server.process import LabServer

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--gpu-memory-utilization", "0.4"])).gpu_memory_utilization == 0.4
    srv = LabServer("tiny-random", port=1234, gpu_memory_utilization=0.4)
    assert srv.cmd[srv.cmd.index("--gpu-memory-utilization") + 1] == "0.4"
