"""Token logprobs from the engine against a direct log_softmax of the model's logits, teacher-forced on the same
tokens (one plain causal forward, no KV cache): sampled and prompt tokens, in a batch with chunked prefills,
after the penalties and the grammar mask, through speculative decoding, prefix caching and preemption."""
from __future__ import annotations

import pytest
import torch

from lab_utils import EngineConfig, LLMEngine, SamplingParams, load_model
from lab_utils.checks.teacher_forced import score
from lab_utils.engine.config import SpecConfig

PROMPTS = [[5, 17, 99, 3, 40, 41, 42, 43, 44, 45, 46, 47, 48], [7, 8, 9], [300, 301, 302, 303, 304, 305]]
TOL = 1e-4  # float32: the paged, chunked path and one plain forward round differently (seen: ~1e-6)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random", device="cpu", dtype=torch.float32)


def _engine(tiny, **cfg) -> LLMEngine:
    base = dict(max_num_seqs=8, max_num_batched_tokens=8, block_size=4, num_gpu_blocks=256)
    return LLMEngine(tiny, EngineConfig(**{**base, **cfg}), device="cpu")


def _reference(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(prompt) + len(output) - 1, V]: log_softmax of the logits scoring every token after the first."""
    return torch.log_softmax(score(model, prompt + output)[:-1], dim=-1)


def _check(entries, ref: torch.Tensor, tokens: list[int], k: int) -> None:
    assert len(entries) == len(tokens) == ref.shape[0]
    for e, row, tok in zip(entries, ref, tokens):
        assert e.token_id == tok
        assert e.logprob == pytest.approx(float(row[tok]), abs=TOL)
        want = row.topk(k)
        assert len(e.top) == k
        assert [lp for _, lp in e.top] == pytest.approx(want.values.tolist(), abs=TOL)
        assert [t for t, _ in e.top] == want.indices.tolist()


def test_sampled_and_prompt_logprobs_match_a_direct_log_softmax(tiny):
    eng = _engine(tiny)
    asks = SamplingParams(max_tokens=10, temperature=0.9, seed=3, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    params = [asks, SamplingParams(max_tokens=10, ignore_eos=True), asks]
    outs = eng.generate(PROMPTS, params)
    eng.block_manager.check_all_free()
    assert outs[1].logprobs is None and outs[1].prompt_logprobs is None
    for prompt, out in zip(PROMPTS[::2], outs[::2]):
        ref = _reference(tiny[0], prompt, out.token_ids)
        n = len(prompt) - 1
        _check(out.logprobs, ref[n:], out.token_ids, 5)
        assert out.prompt_logprobs[0] is None
        _check(out.prompt_logprobs[1:], ref[:n], prompt[1:], 3)


def _penalised(model, prompt: list[int], output: list[int], p: dict) -> torch.Tensor:
    """log_softmax of the logits before each output token with the penalties written out by hand."""
    logits = score(model, prompt + output)[len(prompt) - 1:-1]
    want = []
    for i, row in enumerate(logits):
        seen = torch.zeros_like(row, dtype=torch.bool)
        seen[prompt + output[:i]] = True
        row = torch.where(seen, torch.where(row > 0, row / p["repetition_penalty"], row * p["repetition_penalty"]), row)
        counts = torch.zeros_like(row)
        for t in output[:i]:
            counts[t] += 1
        want.append(row - p["frequency_penalty"] * counts - p["presence_penalty"] * (counts > 0).float())
    return torch.log_softmax(torch.stack(want), -1)


PENALTIES = dict(frequency_penalty=0.8, presence_penalty=0.3, repetition_penalty=1.4)


def test_logprobs_are_taken_after_the_penalties(tiny):
    """The same logits the sampler draws from."""
    prompt, p = PROMPTS[0], PENALTIES
    out = _engine(tiny).generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2, **p))[0]
    _check(out.logprobs, _penalised(tiny[0], prompt, out.token_ids, p), out.token_ids, 2)
    raw = _reference(tiny[0], prompt, out.token_ids)[len(prompt) - 1:]
    assert max(abs(e.logprob - float(r[t])) for e, r, t in zip(out.logprobs, raw, out.token_ids)) > 0.05


def test_logprobs_are_taken_after_the_grammar_mask(tiny):
    """A choice grammar: all probability sits on the tokens it allows, and the chosen one's logprob is its
    logit's log_softmax over those tokens alone."""
    pytest.importorskip("xgrammar")
    eng = _engine(tiny)
    no = tiny[1]("no", add_special_tokens=False).input_ids[0]
    out = eng.generate([PROMPTS[1]], SamplingParams(max_tokens=8, logprobs=20, logit_bias={no: 3.0},
                                                    structured_output={"choice": ["yes", "no"]}))[0]
    first = out.logprobs[0]
    allowed = [(t, lp) for t, lp in first.top if lp > float("-inf")]
    assert 0 < len(allowed) < 20 and sum(torch.tensor([lp for _, lp in allowed]).exp()) == pytest.approx(1, abs=1e-5)
    raw = score(tiny[0], PROMPTS[1])[-1]
    raw[no] += 3.0  # the bias applies after the grammar mask, as vLLM's processors do
    assert no in [t for t, _ in allowed] and out.text == "no"
    ids = torch.tensor([t for t, _ in allowed])
    want = torch.log_softmax(raw[ids], -1)
    assert [lp for _, lp in allowed] == pytest.approx(want.tolist(), abs=TOL)


def test_logprobs_through_speculative_decoding(tiny):
    """Every token of a verify step (kept guesses, then the correction or bonus) has the target's logprobs of its
    own row."""
    eng = _engine(tiny, speculative=SpecConfig("ngram", 3))
    prompt = PROMPTS[0]
    out = eng.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2))[0]
    assert eng.stats()["spec_num_accepted"] > 0
    _check(out.logprobs, _reference(tiny[0], prompt, out.token_ids)[len(prompt) - 1:], out.token_ids, 2)


def test_prompt_logprobs_skip_the_prefix_cache_and_survive_preemption(tiny):
    prompt = PROMPTS[0] * 2
    eng = _engine(tiny, num_gpu_blocks=14, enable_prefix_caching=True)
    eng.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))  # its blocks are now cached
    params = [SamplingParams(max_tokens=20, ignore_eos=True, prompt_logprobs=1)] + \
             [SamplingParams(max_tokens=20, ignore_eos=True)] * 2
    outs = eng.generate([prompt, PROMPTS[2] * 2, PROMPTS[1] * 3], params)
    assert eng.stats()["num_preemptions"] > 0 and outs[0].num_cached_tokens == 0
    eng.block_manager.check_all_free()
    _check(outs[0].prompt_logprobs[1:], _reference(tiny[0], prompt, [])[: len(prompt) - 1], prompt[1:], 1)


def test_logprobs_and_penalties_through_cuda_graph_replays(tiny, monkeypatch):
    """Decode steps replayed from (fake, CPU) CUDA graphs: the processors and logprobs work on the replay's
    logits exactly as on the eager path's."""
    from test_cuda_logic import _FakeCuda, _graph_engine

    eng = _graph_engine(tiny, max_num_seqs=8)
    fake = _FakeCuda(eng.runner.graphs)
    fake.install(monkeypatch)
    eng.runner.graphs.capture = True
    params = [SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2),
              SamplingParams(max_tokens=10, ignore_eos=True),
              SamplingParams(max_tokens=10, ignore_eos=True, logprobs=1, **PENALTIES)]
    outs = eng.generate(PROMPTS, params)
    assert fake.replays > 0 and eng.runner.fast_path_error is None
    first, _, third = outs
    ref = _reference(tiny[0], PROMPTS[0], first.token_ids)
    n = len(PROMPTS[0]) - 1
    _check(first.logprobs, ref[n:], first.token_ids, 3)
    _check(first.prompt_logprobs[1:], ref[:n], PROMPTS[0][1:], 2)
    _check(third.logprobs, _penalised(tiny[0], PROMPTS[2], third.token_ids, PENALTIES), third.token_ids, 1)
