"""Shared fixtures: models are loaded once per session (SmolLM2 takes ~1 s from the prepared folder)."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LAB_CHECKS_LOG", "off")  # tests record no check results (test_workshop_records turns it on)


@pytest.fixture(scope="session")
def smollm2():
    from lab_utils import load_model

    return load_model("smollm2-135m", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny64():
    """The 2-layer random model in float64: batching cannot flip a greedy argmax through rounding."""
    from lab_utils import load_model

    return load_model("tiny-random", device="cpu", dtype=torch.float64)


@pytest.fixture
def tiny_cpu_engine_run():
    """Run a small mixed workload (7 prompts of 2-7 tokens, 20 greedy tokens each, chunked prefills, 4 at a time)
    through a fresh float32 tiny-random engine on the CPU; returns (engine, token ids per request) after checking
    every KV block came back. For A/B tests of the CPU fast paths: call it, flip a switch, call it again.

    `run(score=tokens)` also returns the engine's logits over those tokens (one [20, vocab] tensor a request),
    teacher-forced through the same batched workload (`checks.teacher_forced`), and `run(score="own")` over its
    own greedy tokens: two numerically different paths are compared on the same tokens, never free-running."""
    from lab_utils import EngineConfig, LLMEngine, SamplingParams, load_model
    from lab_utils.checks.teacher_forced import engine_logits_batch

    model, tok = load_model("tiny-random", device="cpu", dtype=torch.float32)
    prompts = [[5 + i, 17, 99, 3 * i + 1, 40, 41, 42][: 2 + i % 6] for i in range(7)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)

    def run(score=None):
        eng = LLMEngine((model, tok), EngineConfig(max_num_seqs=4, num_gpu_blocks=64, block_size=4,
                                                   max_num_batched_tokens=16), device="cpu")
        out = [o.token_ids for o in eng.generate(prompts, params)]
        eng.block_manager.check_all_free()
        if score is None:
            return eng, out
        logits = engine_logits_batch(eng, prompts, out if score == "own" else score)
        eng.block_manager.check_all_free()
        return eng, out, logits

    return run

