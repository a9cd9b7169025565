"""Engine correctness: batching, scheduling policies, paging, chunking and caching never change greedy output."""
from __future__ import annotations

import random

import pytest
import torch

from lab_utils import EngineConfig, LLMEngine, SamplingParams
from lab_utils.engine.request import Status


def _prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _solo(model_tok, prompts, max_tokens, **cfg) -> list[list[int]]:
    """Reference: each prompt alone through a fresh engine (batch of one, no sharing)."""
    eng = LLMEngine(model_tok, EngineConfig(max_num_seqs=1, enable_prefix_caching=False, **cfg), device="cpu")
    return [eng.generate([p], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids for p in prompts]


def _run(model_tok, prompts, max_tokens, **cfg):
    eng = LLMEngine(model_tok, EngineConfig(**cfg), device="cpu")
    outs = eng.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    eng.block_manager.check_all_free()
    return eng, [o.token_ids for o in outs]


def test_smollm2_engine_matches_hf_generate(smollm2):
    from transformers import AutoModelForCausalLM

    from lab_utils.checks.teacher_forced import compare, engine_logits_batch, rounding_tie

    from lab_utils.models.loader import model_folder

    model, tok = smollm2
    hf = AutoModelForCausalLM.from_pretrained(model_folder("smollm2-135m"), dtype=torch.float32).eval()
    prompts = ["The capital of France is", "def add(a, b):", "Water boils at", "My favourite colour is",
               "Once upon a time, in a small village,"]
    eng = LLMEngine(smollm2, EngineConfig(max_num_seqs=8, max_num_batched_tokens=16), device="cpu")
    outs = eng.generate(prompts, SamplingParams(max_tokens=16))
    # two implementations (paged KV, chunked prefills, batched decode vs HF's): teacher-forced on the engine's
    # tokens, HF's argmax must be the engine's choice wherever HF's margin exceeds the float32 near-tie tolerance,
    # and the engine's logits over those tokens (pinned step by step) lie within 1e-3 of HF's
    ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    conts = [o.token_ids for o in outs]
    with torch.no_grad():
        ref = [hf(torch.tensor([i + c])).logits[0, len(i) - 1 : -1].float() for i, c in zip(ids, conts)]
    tie = rounding_tie(torch.float32, torch.cat(ref))
    for p, r, c in zip(prompts, ref, conts):
        chosen = compare(r, torch.nn.functional.one_hot(torch.tensor(c), r.shape[-1]).float(), tie)
        assert chosen.decisive_fraction == 1.0, f"engine tokens {c} are not HF's argmax for {p!r}: {chosen.describe()}"
    scored = compare(ref, engine_logits_batch(eng, ids, conts), tie)
    assert scored.decisive_fraction == 1.0 and scored.max_abs_diff <= 1e-3, f"engine vs HF: {scored.describe()}"
    eng.block_manager.check_all_free()


@pytest.mark.parametrize("cfg", [
    dict(scheduler="static", max_num_seqs=3),
    dict(scheduler="continuous", max_num_seqs=4),
    dict(scheduler="token_budget", max_num_seqs=5, max_num_batched_tokens=16),
    dict(scheduler="token_budget", max_num_batched_tokens=64, enable_prefix_caching=False),
    dict(scheduler="token_budget", kv_layout="contiguous", max_model_len=128, enable_prefix_caching=False),
    dict(scheduler="continuous", block_size=4, max_num_batched_tokens=32),
])
def test_batched_equals_solo(tiny64, cfg):
    prompts = _prompts(9, seed=1)
    ref = _solo(tiny64, prompts, 12)
    _, got = _run(tiny64, prompts, 12, **cfg)
    assert got == ref  # float64: batching moves a logit by ~1e-15, below any greedy margin (see the tiny64 fixture)


def test_static_batching_admits_nobody_until_the_batch_ends(tiny64):
    eng = LLMEngine(tiny64, EngineConfig(scheduler="static", max_num_seqs=2), device="cpu")
    lens = [2, 8, 3]
    ids = [eng.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(_prompts(3), lens)]
    seen_third_before_second_ended = False
    while eng.has_unfinished():
        eng.step()
        r2, r3 = eng.requests[ids[1]], eng.requests[ids[2]]
        if r3.status is Status.RUNNING and not r2.status.done:
            seen_third_before_second_ended = True
    assert not seen_third_before_second_ended


def test_continuous_batching_fills_freed_slots(tiny64):
    eng = LLMEngine(tiny64, EngineConfig(scheduler="continuous", max_num_seqs=2), device="cpu")
    ids = [eng.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True))
           for p, m in zip(_prompts(3), [2, 8, 3])]
    joined_early = False
    while eng.has_unfinished():
        eng.step()
        if eng.requests[ids[2]].status is Status.RUNNING and not eng.requests[ids[1]].status.done:
            joined_early = True
    assert joined_early


def test_token_budget_mixes_prefill_and_decode_and_respects_budget(tiny64):
    eng = LLMEngine(tiny64, EngineConfig(scheduler="token_budget", max_num_batched_tokens=16), device="cpu")
    eng.add_request(_prompts(1, lo=5, hi=5)[0], SamplingParams(max_tokens=20, ignore_eos=True))
    eng.step()
    eng.add_request(_prompts(1, seed=3, lo=60, hi=60)[0], SamplingParams(max_tokens=2, ignore_eos=True))
    mixed = False
    while eng.has_unfinished():
        eng.step()
        if not eng.step_log:
            continue
        last = eng.step_log[-1]
        assert last["num_tokens"] <= 16
        if len(last["requests"]) == 2 and max(n for _, n in last["requests"]) > 1:
            mixed = True
    assert mixed, "a decode never shared a step with a prefill chunk"


def test_prefix_cache_hits_and_outputs_unchanged(tiny64):
    system = _prompts(1, seed=7, lo=48, hi=48)[0]
    prompts = [system + q for q in _prompts(4, seed=8, lo=3, hi=6)]
    ref = _solo(tiny64, prompts, 6)
    eng = LLMEngine(tiny64, EngineConfig(max_num_seqs=1, block_size=16), device="cpu")
    got = [eng.generate([p], SamplingParams(max_tokens=6, ignore_eos=True))[0] for p in prompts]
    assert [o.token_ids for o in got] == ref
    assert got[0].num_cached_tokens == 0 and all(o.num_cached_tokens == 48 for o in got[1:])
    assert eng.stats()["prefix_cache_hit_rate"] > 0.5
    eng.block_manager.check_all_free()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs(tiny64, mode):
    prompts = _prompts(8, seed=5, lo=10, hi=30)
    ref = _solo(tiny64, prompts, 20)
    eng, got = _run(tiny64, prompts, 20, num_gpu_blocks=8, block_size=8, max_num_seqs=8,
                    preemption_mode=mode, max_num_batched_tokens=64)
    assert got == ref
    assert eng.stats()["num_preemptions"] > 0


def test_abort_mid_generation_frees_blocks(tiny64):
    eng = LLMEngine(tiny64, EngineConfig(), device="cpu")
    a = eng.add_request(_prompts(1)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    b = eng.add_request(_prompts(1, seed=2)[0], SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.abort(a)
    assert not eng.abort(a), "aborting twice must say it had already ended"
    finished = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
    assert finished[a].finish_reason == "abort" and finished[b].finish_reason == "length"
    assert eng.stats()["num_aborted"] == 1 and eng.stats()["num_finished"] == 1
    eng.block_manager.check_all_free()


def test_rejections_are_explicit(tiny64):
    eng = LLMEngine(tiny64, EngineConfig(max_model_len=64, num_gpu_blocks=2, block_size=16), device="cpu")
    too_long = eng.add_request(list(range(100, 170)), SamplingParams(max_tokens=4))
    too_big = eng.add_request(list(range(100, 150)), SamplingParams(max_tokens=4))
    outs = {o.request_id: o for o in eng.step()}
    assert "max_model_len" in outs[too_long].finish_reason
    assert "KV blocks" in outs[too_big].finish_reason
    assert eng.stats()["num_rejected"] == 2


def test_stop_strings_and_length(smollm2):
    eng = LLMEngine(smollm2, EngineConfig(), device="cpu")
    out = eng.generate(["Count: 1, 2, 3,"], SamplingParams(max_tokens=30, stop=[" 6"]))[0]
    assert out.finish_reason == "stop" and " 6" not in out.text
    out = eng.generate(["Count: 1, 2, 3,"], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_seeded_sampling_is_independent_of_batch(tiny64):
    prompts = _prompts(4, seed=11)
    sp = [SamplingParams(max_tokens=8, temperature=1.0, top_k=50, top_p=0.9, seed=100 + i) for i in range(4)]
    eng = LLMEngine(tiny64, EngineConfig(max_num_seqs=4), device="cpu")
    batched = [o.token_ids for o in eng.generate(prompts, sp)]
    solo = [eng.generate([p], [s])[0].token_ids for p, s in zip(prompts, sp)]
    assert batched == solo


@pytest.mark.parametrize("bad", [dict(max_num_seqs=0), dict(block_size=3), dict(scheduler="fifo"),
                                 dict(kv_cache_dtype="fp4"), dict(max_num_batched_tokens=8, block_size=16),
                                 dict(preemption_mode="drop")])
def test_invalid_engine_config(bad):
    field = next(iter(bad)) if "block_size" not in bad or len(bad) == 1 else "max_num_batched_tokens"
    with pytest.raises(ValueError, match=field):
        EngineConfig(**bad)


def test_chunked_prefill_off_needs_budget_of_max_model_len(tiny64):
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        LLMEngine(tiny64, EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=256), device="cpu")


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2)])
def test_invalid_sampling_params(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)
