"""vLLM beside the lab engine on a GPU: bf16, CUDA graphs on, a capped share of the card (the device check is
mocked, so this runs on a CPU and needs no vLLM)."""
from __future__ import annotations

import sys
import types

import pytest

from lab_utils import vllm_env


@pytest.fixture
def on_gpu(monkeypatch):
    monkeypatch.setattr(vllm_env, "is_cpu", lambda: False)


def test_llm_kwargs_gpu_defaults(on_gpu):
    kw = vllm_env.llm_kwargs()
    assert kw["dtype"] == "bfloat16" and kw["enforce_eager"] is False
    assert kw["gpu_memory_utilization"] == vllm_env.DEFAULT_GPU_MEMORY_UTILIZATION <= 0.5
    assert "kv_cache_memory_bytes" not in kw
    # what the caller passes wins
    kw = vllm_env.llm_kwargs(dtype="float16", enforce_eager=True, gpu_memory_utilization=0.2)
    assert (kw["dtype"], kw["enforce_eager"], kw["gpu_memory_utilization"]) == ("float16", True, 0.2)


def test_llm_kwargs_cpu_defaults(monkeypatch):
    monkeypatch.setattr(vllm_env, "is_cpu", lambda: True)
    kw = vllm_env.llm_kwargs()
    assert kw["dtype"] == "float32" and kw["enforce_eager"] is True and "gpu_memory_utilization" not in kw
    assert kw["kv_cache_memory_bytes"] == vllm_env.DEFAULT_CPU_KV_BYTES


def test_vllm_server_on_gpu_runs_bf16_with_graphs_and_a_memory_cap(on_gpu):
    srv = vllm_env.VLLMServer("/m", port=1234, max_num_seqs=3)
    a = srv.cmd[srv.cmd.index("vllm.entrypoints.openai.api_server") + 1:]
    assert a[a.index("--dtype") + 1] == "bfloat16"
    assert "--enforce-eager" not in a and "--no-enforce-eager" in a
    assert float(a[a.index("--gpu-memory-utilization") + 1]) == vllm_env.DEFAULT_GPU_MEMORY_UTILIZATION


def test_vllm_backend_on_gpu(on_gpu, monkeypatch):
    from lab_utils import EngineConfig
    from lab_utils.bench import backends_vllm

    monkeypatch.setattr(vllm_env, "require", lambda: "vllm (mocked)")
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=None))
    llm = types.SimpleNamespace(llm_engine=None)
    be = backends_vllm.VLLMBackend("smollm2-135m", EngineConfig(max_num_seqs=8), llm=llm)
    kw = be.kwargs
    assert kw["dtype"] == "bfloat16" and kw["enforce_eager"] is False and kw["max_num_seqs"] == 8
    assert kw["gpu_memory_utilization"] == vllm_env.DEFAULT_GPU_MEMORY_UTILIZATION


def test_lab_vllm_0_turns_vllm_off(monkeypatch):
    monkeypatch.setenv("LAB_VLLM", "0")
    ok, why = vllm_env.available()
    assert not ok and "LAB_VLLM=0" in why
