"""Hypothesis on LLMEngine.add_request: whatever ids and sampling fields a caller passes, the engine either says
no at once (ValueError naming the problem) or runs the request to its end; a step never raises, and every KV
block comes back."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lab_utils import EngineConfig, LLMEngine, SamplingParams, load_model

VOCAB = 49152


@pytest.fixture(scope="module")
def engine():
    model, tok = load_model("tiny-random", device="cpu", dtype=torch.float32)
    # a small pool (8 blocks x 16 tokens) and a short context, so that some requests must be rejected
    return LLMEngine((model, tok), EngineConfig(max_num_seqs=4, num_gpu_blocks=8, block_size=16,
                                                max_num_batched_tokens=64, max_model_len=96), device="cpu")


token = st.one_of(st.integers(0, VOCAB - 1), st.integers(-(2 ** 70), 2 ** 70), st.sampled_from([-1, VOCAB]),
                  st.floats(allow_nan=True), st.booleans(), st.text(max_size=2))
prompt = st.one_of(st.lists(token, max_size=12), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=120),
                   st.text(max_size=40))
fields = st.fixed_dictionaries({}, optional={
    "max_tokens": st.one_of(st.integers(-2, 80), st.floats(allow_nan=True), st.booleans()),
    "temperature": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1e-30, 0.5, 2.0])),
    "top_k": st.one_of(st.integers(-2, VOCAB + 5), st.floats(0, 5)),
    "top_p": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([5e-324, 1e-181, 1e-9, 0.5, 1.0])),
    "seed": st.one_of(st.none(), st.integers(-(2 ** 65), 2 ** 65)),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), st.integers()),
    "stop_token_ids": st.lists(st.one_of(st.integers(-2, VOCAB + 2), st.text(max_size=1)), max_size=3),
    "ignore_eos": st.one_of(st.booleans(), st.integers(0, 2)),
})


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=prompt, kw=fields, batch=st.integers(1, 3))
def test_add_request_says_no_or_finishes(engine, prompt, kw, batch):
    try:
        params = SamplingParams(**kw)
    except ValueError as exc:
        assert "SamplingParams." in str(exc) and "must be" in str(exc)
        return
    assert math.isfinite(params.temperature) and (params.temperature == 0 or params.temperature >= 1e-2)
    ids = []
    for _ in range(batch):  # the same request several times: they share steps
        try:
            ids.append(engine.add_request(prompt, params))
        except ValueError as exc:
            assert str(exc), "a refusal must say why"
            assert not ids
            return
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():  # must never raise
            if out.finished:
                outs[out.request_id] = out
    assert set(ids) <= set(outs)
    for rid in ids:
        out = outs[rid]
        assert out.finish_reason in ("stop", "length") or out.finish_reason.startswith("rejected: "), out.finish_reason
        assert len(out.token_ids) <= params.max_tokens
        assert all(0 <= t < VOCAB for t in out.token_ids)
    engine.block_manager.check_all_free()


def test_out_of_vocabulary_ids_are_refused_by_name(engine):
    for bad, word in (([10_000_000], "outside this model's vocabulary"), ([3, -1], "prompt[1]=-1"),
                      ([1.0], "not a token id"), ([True], "not a token id"), (42, "sequence of token ids")):
        with pytest.raises(ValueError, match=word.replace("[", r"\[").replace("]", r"\]")):
            engine.add_request(bad, SamplingParams(max_tokens=2))
    assert not engine.has_unfinished()


def test_a_tiny_top_p_samples_the_most_likely_token(engine):
    """top_p=1e-181 is 0 in float32: unclamped, the sampler dropped every token and sampled from NaNs (found by
    the API fuzzer). It must act as top_p -> 0: the most likely token, every time."""
    greedy = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    tiny = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, top_p=1e-181,
                                                       seed=3))[0].token_ids
    assert tiny == greedy
