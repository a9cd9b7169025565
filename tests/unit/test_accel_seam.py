"""The accelerations' seam: EngineConfig's CPU switches (defaults from the environment) reach one engine's model
view and runner, and the attention backends hand each step the attention callable the registry names."""
from __future__ import annotations

import pytest
import torch

from lab_utils import EngineConfig, LLMEngine
from lab_utils.engine.accel.attention_backends import step_attention
from lab_utils.engine.accel.cpu_attention import CpuDecodeAttention
from lab_utils.engine.accel.cpu_fused import FusedLlamaForCausalLM
from lab_utils.engine.accel.cpu_kernels import cpu_kernels
from lab_utils.engine.accel.cpu_linear import PackedLinear, packed_linear_available
from lab_utils.engine.accel.flex_attention import flex_available
from lab_utils.engine.accel.split_attention import SplitPagedAttention
from lab_utils.engine.attention import PagedAttention
from lab_utils.engine.config import CPU_SWITCH_ENV
from lab_utils.engine.kv.kv_cache import KVCache
from lab_utils.models.llama import LlamaForCausalLM
from lab_utils.models.loader import load_model

needs_onednn = pytest.mark.skipif(not packed_linear_available(torch.device("cpu"), torch.float32),
                                  reason="needs oneDNN (torch.backends.mkldnn)")


@pytest.fixture
def no_switch_env(monkeypatch):
    for var in CPU_SWITCH_ENV.values():
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_switch_defaults_come_from_the_environment(no_switch_env):
    assert all(getattr(EngineConfig(), name) is True for name in CPU_SWITCH_ENV)
    for name, var in CPU_SWITCH_ENV.items():
        no_switch_env.setenv(var, "0")
        assert getattr(EngineConfig(), name) is False  # read when the config is built
        assert getattr(EngineConfig(**{name: True}), name) is True  # an explicit value wins
        no_switch_env.delenv(var)
    with pytest.raises(ValueError, match=r"EngineConfig.cpu_kernels=0 is invalid: must be True or False"):
        EngineConfig(cpu_kernels=0)


@needs_onednn
def test_config_switches_reach_the_engines_model_and_runner(no_switch_env):
    model, tok = load_model("tiny-random", device="cpu", dtype=torch.float32)

    def engine(**switches) -> LLMEngine:
        return LLMEngine((model, tok), EngineConfig(num_gpu_blocks=16, **switches), device="cpu")

    assert engine(cpu_packed_linear=False).runner.model is model
    assert type(engine(cpu_fused_layers=False).runner.model) is LlamaForCausalLM
    unfused = [m for m in engine(cpu_fused_layers=False).runner.model.modules() if isinstance(m, PackedLinear)]
    assert unfused and all(m.kernels is True for m in unfused)
    assert all(m.small_m_rows == 0 for m in engine(cpu_small_m_linear=False).runner.model.modules()
               if hasattr(m, "small_m_rows"))
    off = engine(cpu_kernels=False)
    assert not off.runner.cpu_decode_kernel
    assert type(off.runner.model) is FusedLlamaForCausalLM and off.runner.model.kernels_on is False
    assert all(m.kernels is False for m in off.runner.model.modules() if hasattr(m, "small_m_rows"))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_attention_backends_hand_each_step_its_callable():
    cpu = torch.device("cpu")
    cache = KVCache(1, 64, 4, 1, 8, torch.float32, torch.float32, cpu)
    tables, ctx = [[i] for i in range(10)], [3] * 10

    def attention(backend: str, n: int, off=("cpu_kernel",)):
        return step_attention(backend, cache, tables[:n], ctx[:n], [1] * n, 4, cpu, off)

    assert type(attention("sdpa", 10)) is SplitPagedAttention  # more decode rows than one group: split
    assert type(attention("sdpa", 2)) is PagedAttention  # nothing to split
    if cpu_kernels() is not None:  # the kernel, while the runner has it on, takes decode rows first
        assert type(attention("sdpa", 10, off=())) is CpuDecodeAttention
    if flex_available():
        from lab_utils.engine.accel.flex_attention import FlexPagedAttention

        assert type(attention("flex", 10)) is FlexPagedAttention
    with pytest.raises(ValueError, match="attention backend 'triton' is invalid"):
        attention("triton", 1)


@needs_onednn
def test_draft_model_follows_the_engines_switches():
    """A draft model's fast paths follow the engine's config, not only the environment."""
    from lab_utils.engine.config import SpecConfig

    model = load_model("tiny-random", device="cpu", dtype=torch.float32)
    spec = SpecConfig("draft", 2, model="tiny-random")
    on = LLMEngine(model, EngineConfig(cpu_packed_linear=True, cpu_fused_layers=True, speculative=spec), device="cpu")
    off = LLMEngine(model, EngineConfig(cpu_packed_linear=False, speculative=spec), device="cpu")
    assert isinstance(on.spec.proposer.model, FusedLlamaForCausalLM)
    assert isinstance(off.spec.proposer.model, LlamaForCausalLM)
