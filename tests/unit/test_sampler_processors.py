"""The sampler's logit processors (logit_bias, min_tokens, repetition / frequency / presence penalties): each one
on real tiny-model logits against its definition written out here, then its effect on what the engine generates;
rows that do not ask are untouched; out-of-range values are refused; speculation leaves such rows alone."""
from __future__ import annotations

import pytest
import torch

from lab_utils import EngineConfig, LLMEngine, SamplingParams, load_model
from lab_utils.checks.teacher_forced import score
from lab_utils.engine.config import SpecConfig
from lab_utils.engine.sampler import apply_logit_processors, penalize

PROMPT = [5, 17, 99, 3, 40, 41, 42, 43, 44, 45]
OUTPUT = [45, 45, 300, 45, 1000]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def row(tiny):
    """The model's logits [1, V] after PROMPT + OUTPUT: what the sampler would see at the next step."""
    return score(tiny[0], PROMPT + OUTPUT)[-1:].clone()


def _engine(tiny, **cfg) -> LLMEngine:
    base = dict(max_num_seqs=8, max_num_batched_tokens=16, block_size=4, num_gpu_blocks=256)
    return LLMEngine(tiny, EngineConfig(**{**base, **cfg}), device="cpu")


def _gen(eng: LLMEngine, **params) -> list[int]:
    out = eng.generate([PROMPT], SamplingParams(**{"max_tokens": 12, "ignore_eos": True, **params}))[0]
    eng.block_manager.check_all_free()
    return out.token_ids


def _run(row, **params):
    return penalize(row, [PROMPT + OUTPUT], [OUTPUT], [SamplingParams(**params)], [[]])


def test_logit_bias_adds_to_exactly_the_named_tokens(tiny, row):
    got = _run(row, logit_bias={7: 5.0, 45: -3.5})
    diff = got - row
    assert diff[0, 7] == pytest.approx(5.0) and diff[0, 45] == pytest.approx(-3.5)
    diff[0, [7, 45]] = 0
    assert torch.equal(diff, torch.zeros_like(diff))
    plain = _gen(_engine(tiny))
    assert plain != [7] * 12
    assert _gen(_engine(tiny), logit_bias={7: 100.0}) == [7] * 12  # +100 makes it the only choice


def test_frequency_and_presence_penalties_count_the_output_only(tiny, row):
    counts = torch.zeros_like(row)
    for t in OUTPUT:
        counts[0, t] += 1
    want = row - 0.7 * counts - 1.1 * (counts > 0).float()
    assert torch.allclose(_run(row, frequency_penalty=0.7, presence_penalty=1.1), want)
    assert torch.equal(_run(row, frequency_penalty=0.7)[0, PROMPT[0]], row[0, PROMPT[0]])  # prompt tokens: no
    plain = _gen(_engine(tiny))
    assert len(set(plain)) <= 3, plain  # the random model repeats itself
    for kind in ("frequency_penalty", "presence_penalty"):
        out = _gen(_engine(tiny), **{kind: 2.0})
        assert len(set(out)) > len(set(plain)), (kind, out, plain)


def test_repetition_penalty_is_vllms_over_prompt_and_output(tiny, row):
    seen = torch.zeros_like(row, dtype=torch.bool)
    seen[0, PROMPT + OUTPUT] = True
    p = 1.3
    want = torch.where(seen, torch.where(row > 0, row / p, row * p), row)
    got = _run(row, repetition_penalty=p)
    assert torch.allclose(got, want)
    assert got[0, PROMPT[0]] != row[0, PROMPT[0]]  # a token seen only in the prompt counts too
    plain = _gen(_engine(tiny))
    out = _gen(_engine(tiny), repetition_penalty=2.0)
    assert len(set(out)) > len(set(plain)), (out, plain)


def test_min_tokens_masks_end_and_stop_tokens_until_enough_are_out(tiny, row):
    eng = _engine(tiny)
    eos = min(eng.eos_ids)
    got = penalize(row, [PROMPT], [OUTPUT], [SamplingParams(min_tokens=3)], [[eos, 7]])
    assert torch.isneginf(got[0, [eos, 7]]).all() and torch.isfinite(got[0, 8])
    ending = {"logit_bias": {eos: 100.0}, "ignore_eos": False}
    assert len(_gen(eng, **ending)) == 1  # the end token at once
    out = eng.generate([PROMPT], SamplingParams(max_tokens=12, min_tokens=5, **ending))[0]
    assert out.token_ids[-1] == eos and len(out.token_ids) == 6 and out.finish_reason == "stop"
    out = eng.generate([PROMPT], SamplingParams(max_tokens=12, min_tokens=3, stop_token_ids=[7], ignore_eos=True,
                                                logit_bias={7: 100.0}))[0]
    assert 7 not in out.token_ids[:3] and out.token_ids[3:] == [7] and out.finish_reason == "stop"


def test_min_tokens_never_empties_a_row(row):
    """A grammar that can only end leaves one finite logit (the end token): min_tokens does not take it."""
    only_end = torch.full_like(row, float("-inf"))
    only_end[0, 2] = 0.0
    got = penalize(only_end, [PROMPT], [[]], [SamplingParams(min_tokens=4)], [[2]])
    assert torch.equal(got, only_end)


def test_rows_that_do_not_ask_are_untouched(tiny):
    eng = _engine(tiny, max_num_batched_tokens=64)
    for i, p in enumerate([SamplingParams(), SamplingParams(presence_penalty=1.0, logit_bias={3: 2.0}),
                           SamplingParams(), SamplingParams(repetition_penalty=1.5)]):
        eng.add_request(PROMPT[: 4 + i], p)
    sched = eng.scheduler.schedule()
    logits, reqs = eng.runner.run(sched.scheduled)
    assert len(reqs) == 4
    before = logits.clone()
    plain_only = [reqs[0], reqs[2]]
    same = logits[[0, 2]]
    assert apply_logit_processors(same, plain_only, eng.eos_ids) is same  # nobody asks: the tensor as it was
    after = apply_logit_processors(logits, reqs, eng.eos_ids)
    assert torch.equal(after[[0, 2]], before[[0, 2]])
    assert not torch.equal(after[1], before[1]) and not torch.equal(after[3], before[3])


@pytest.mark.parametrize("field,value", [
    ("logit_bias", {5: 101.0}), ("logit_bias", {5: float("nan")}), ("logit_bias", {-1: 1.0}),
    ("frequency_penalty", 2.5), ("presence_penalty", -2.01), ("repetition_penalty", 0.0),
    ("repetition_penalty", float("inf")), ("min_tokens", 13), ("logprobs", 21), ("prompt_logprobs", -1),
])
def test_out_of_range_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(max_tokens=12, **{field: value})


def test_logit_bias_outside_the_vocabulary_is_refused_at_add_request(tiny):
    eng = _engine(tiny)
    with pytest.raises(ValueError, match="logit_bias names token id 49152"):
        eng.add_request(PROMPT, SamplingParams(logit_bias={49152: 1.0}))
    assert not eng.has_unfinished()


def test_speculation_leaves_rows_with_processors_to_the_plain_step(tiny):
    """ngram guesses keep coming for a plain request; a request with penalties gets none (its penalties depend on
    every token before), and generates what the engine without speculation generates."""
    spec = _engine(tiny, speculative=SpecConfig("ngram", 3))
    _gen(spec)
    assert spec.stats()["spec_num_proposed"] > 0
    asked = {"presence_penalty": 0.5, "repetition_penalty": 1.05}
    spec = _engine(tiny, speculative=SpecConfig("ngram", 3))
    assert _gen(spec, **asked) == _gen(_engine(tiny), **asked)
    assert spec.stats()["spec_num_proposed"] == 0
