"""The facts behind quiz answers that name a real system's behaviour, measured here rather than taken on trust:
a wrong fact in the quiz's explanation makes one of these fail."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lab_utils import EngineConfig, LLMEngine, SamplingParams, load_model, quiz
from lab_utils.efficiency import fanout


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random", device="cpu", dtype=torch.float64)


def _engine(tiny):
    config = EngineConfig(block_size=16, num_gpu_blocks=400, max_num_batched_tokens=4096, max_num_seqs=16, seed=0)
    return LLMEngine(tiny, config, device="cpu")  # keeps its step log (keep_history) by default


def test_fanout_prefill_same_step_requests_compute_the_whole_prefix_each(tiny):
    """Quiz 15 fanout_prefill: 8 prompts of 400 shared + 20 own tokens, admitted together, compute 8 x 420; fanned
    out after the first's prompt, 400 + 8 x 20 (up to the block the shared prefix does not fill)."""
    shared = [(7 * i) % 4000 + 5 for i in range(400)]
    prompts = [shared + [(13 * i + j) % 4000 + 5 for j in range(20)] for i in range(8)]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    q = quiz.get("15", "fanout_prefill")
    eng = _engine(tiny)
    outs = fanout.all_at_once(eng, prompts, params)
    assert fanout.prompt_tokens_computed(eng, outs) == q.answer == 8 * 420
    eng = _engine(tiny)
    outs = fanout.fan_out(eng, prompts, params)
    assert fanout.prompt_tokens_computed(eng, outs) == 400 + 8 * 20 == 560
    assert "560" in q.explanation


_ENGINE_NAME = "from lab_utils.engine.kv.prefix_cache import block_hash; print(block_hash(None, (1, 2, 3)))"


def test_store_names_engine_names_differ_per_process_only_before_3_12():
    """Quiz 14 store_names: the engine's first block name hashes None, whose hash comes from None's address up to
    CPython 3.11 (another value in each process) and is a constant from 3.12."""
    runs = {subprocess.run([sys.executable, "-c", _ENGINE_NAME], capture_output=True, text=True, check=True).stdout
            for _ in range(3)}
    assert len(runs) == (1 if sys.version_info >= (3, 12) else 3)
    q = quiz.get("14", "store_names")
    assert "3.12" in q.explanation and "PYTHONHASHSEED" in q.explanation and "NONE_HASH" in q.explanation


def _vllm_source(relative: str) -> str:
    """The text of an installed vLLM source file (read, not imported), or skip where vLLM is not installed."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        pytest.skip("vLLM is not installed")
    return (Path(spec.origin).parent / relative).read_text()


def _function_body(source: str, name: str) -> str:
    start = source.index(f"def {name}(")
    nxt = source.find("\n    def ", start + 1)
    return source[start:nxt if nxt > 0 else None]


def test_out_of_blocks_vllm_v1_preempts_by_recompute_only():
    """Quiz 02 out_of_blocks: vLLM V1's preemption frees the blocks and resets the computed tokens (recompute);
    nothing in it swaps KV out."""
    body = _function_body(_vllm_source("v1/core/sched/scheduler.py"), "_preempt_request")
    assert "num_computed_tokens = 0" in body and "swap" not in body.lower()
    q = quiz.get("02", "out_of_blocks")
    assert "recompute only" in q.explanation and "swap" not in q.options[ord(q.answer) - ord("a")]

