"""`EngineConfig.attention_backend`: "auto" or a backend's name, validated, chosen in one place
(`attention_backends.select_attention_backend`), never a backend for a dtype it cannot compile (flex: float64)."""
from __future__ import annotations

import argparse

import pytest
import torch

from lab_utils.engine.accel.attention_backends import (
    ATTENTION_BACKENDS,
    backend_names,
    select_attention_backend,
)
from lab_utils.engine.accel.flex_attention import flex_available
from lab_utils.engine.cli import add_engine_args, engine_config_from_args
from lab_utils.engine.config import EngineConfig, attention_backend_names
from lab_utils.engine.engine import LLMEngine

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
needs_flex = pytest.mark.skipif(not flex_available(), reason="needs torch >= 2.5 (flex_attention)")


def test_one_list_of_names_for_config_cli_and_selection():
    assert backend_names() == ("auto", *ATTENTION_BACKENDS) == attention_backend_names()
    for name in backend_names():
        assert EngineConfig(attention_backend=name).attention_backend == name
    with pytest.raises(ValueError, match=r"attention_backend='fast' is invalid: must be one of \('auto', 'sdpa'"):
        EngineConfig(attention_backend="fast")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--attention-backend", "sdpa"])).attention_backend == "sdpa"
    assert engine_config_from_args(parser.parse_args([])).attention_backend == "auto"
    with pytest.raises(SystemExit):  # argparse names the choices
        parser.parse_args(["--attention-backend", "fast"])


@needs_flex
def test_auto_never_picks_flex_for_float64_and_a_named_flex_is_refused():
    assert select_attention_backend("auto", CUDA, torch.float32) == "flex"
    assert select_attention_backend("auto", CUDA, torch.bfloat16) == "flex"
    assert select_attention_backend("auto", CUDA, torch.float64) == "sdpa"
    for device in (CPU, CUDA):
        with pytest.raises(ValueError, match=r"'flex' cannot run a float64 model on .*cannot compile for float64"):
            select_attention_backend("flex", device, torch.float64)
    assert select_attention_backend("flex", CPU, torch.float32) == "flex"
    assert select_attention_backend("sdpa", CUDA, torch.float32) == "sdpa"


def test_the_engine_runs_the_backend_its_config_names(tiny64):
    assert LLMEngine(tiny64, EngineConfig(num_gpu_blocks=8), device="cpu").runner.fast_paths.attention_backend == "sdpa"
    with pytest.raises(ValueError, match="cannot compile for float64" if flex_available() else "torch >= 2.5"):
        LLMEngine(tiny64, EngineConfig(num_gpu_blocks=8, attention_backend="flex"), device="cpu")


@needs_flex
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_named_flex_runs_a_float32_model_on_the_cpu():
    from lab_utils.models.loader import load_model

    eng = LLMEngine(load_model("tiny-random", device="cpu", dtype=torch.float32),
                    EngineConfig(num_gpu_blocks=8, attention_backend="flex"), device="cpu")
    assert eng.runner.fast_paths.attention_backend == "flex"
    assert len(eng.generate([[5, 6, 7]])[0].token_ids) > 0
