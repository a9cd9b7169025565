"""The teacher-forced comparison that numeric A/B tests use: it scores the given tokens through the engine, counts
only decisive positions, and fails on a real difference."""
from __future__ import annotations

import pytest
import torch

from lab_utils import EngineConfig, LLMEngine, SamplingParams, load_model
from lab_utils.checks.teacher_forced import (assert_same_up_to_rounding, compare, engine_logits, engine_logits_batch,
                                             rounding_tie, score)


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows)


def test_a_flip_at_a_near_tie_is_not_counted_a_flip_at_a_clear_margin_is():
    ref = _logits([[5.0, 1.0, 0.0], [2.0, 1.9995, 0.0], [0.0, 3.0, 1.0]])
    near_tie_flip = _logits([[5.0, 1.0, 0.0], [1.9995, 2.0, 0.0], [0.0, 3.0, 1.0]])
    a = compare(ref, near_tie_flip, tie=1e-3)
    assert (a.positions, a.decisive, a.decisive_fraction, a.all_agree) == (3, 2, 1.0, 2)
    real_flip = _logits([[1.0, 5.0, 0.0], [2.0, 1.9995, 0.0], [0.0, 3.0, 1.0]])
    b = compare(ref, real_flip, tie=1e-3)
    assert b.decisive_fraction == 0.5 and b.disagreements[0][0] == 0 and b.max_abs_diff == 4.0
    assert "position 0" in b.describe()
    with pytest.raises(ValueError, match="different shapes"):
        compare(ref, ref[:2], tie=1e-3)


def test_the_rounding_tie_follows_the_dtype():
    logits = torch.tensor([[20.0, -3.0]])
    assert rounding_tie(torch.float32, logits) == 1e-3
    assert rounding_tie(torch.bfloat16, logits) == pytest.approx(8 * 2 ** -7 * 20)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random", device="cpu", dtype=torch.float32)


def test_engine_logits_score_the_given_tokens_as_a_plain_forward_does(tiny):
    """Forced through the engine (prefill, paged KV, decode steps), the logits before each given token are the
    plain model's at that position, for any continuation, not only the engine's own greedy one."""
    model, _ = tiny
    eng = LLMEngine(tiny, EngineConfig(num_gpu_blocks=64, block_size=4), device="cpu")
    prompt, forced = [5, 17, 99, 3], [40, 7, 7, 300, 2, 9]
    got = engine_logits(eng, prompt, forced)
    want = score(model, prompt + forced)[len(prompt) - 1: -1]
    assert got.shape == want.shape
    assert_same_up_to_rounding([want], [got], "the engine's forced path")
    other = engine_logits(eng, prompt, [41, 8, 8, 301, 3, 10])   # other tokens give other logits after the first
    assert torch.allclose(other[0], got[0], atol=1e-5) and not torch.allclose(other[1:], got[1:], atol=1e-3)
    eng.block_manager.check_all_free()


def test_a_batch_is_forced_request_by_request(tiny):
    eng = LLMEngine(tiny, EngineConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=8), device="cpu")
    prompts = [[5, 17, 99], [6, 18], [7, 19, 100, 4, 4, 4, 9]]
    forced = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    batch = engine_logits_batch(eng, prompts, forced)
    alone = [engine_logits(eng, p, c) for p, c in zip(prompts, forced)]
    assert [b.shape[0] for b in batch] == [3, 2, 4]
    assert_same_up_to_rounding(alone, batch, "batched vs one at a time")
    free = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert len(free.token_ids) == 2   # the engine samples freely again afterwards


def test_a_real_difference_fails_the_rounding_comparison():
    torch.manual_seed(0)
    ref = [torch.randn(6, 50) * 5]
    with pytest.raises(AssertionError, match="max \\|logit diff\\|"):
        assert_same_up_to_rounding(ref, [ref[0] + 0.01], "a shifted path")
    flipped = ref[0].clone()
    flipped[2] = -flipped[2]
    with pytest.raises(AssertionError, match="decisive disagreements"):
        assert_same_up_to_rounding(ref, [flipped], "a flipped path")


def test_two_runs_may_part_only_at_a_near_tie(tiny):
    from lab_utils.checks.teacher_forced import same_or_near_tie

    model, _ = tiny
    prompt = [5, 17, 99, 3]
    logits = score(model, prompt)[-1]
    best, worst = int(logits.argmax()), int(logits.argmin())
    assert same_or_near_tie(model, prompt, [best, 7], [best, 7]) == (True, 0.0)
    ok, gap = same_or_near_tie(model, prompt, [best, 7], [worst, 7])   # a clear margin: a real difference
    assert not ok and gap > 0.1
    twin = model.lm_head.weight.detach().clone()                      # make token `worst` an exact twin of `best`
    twin[worst] = twin[best]
    with torch.no_grad():
        saved = model.lm_head.weight.detach().clone()
        model.lm_head.weight.copy_(twin)
        try:
            ok, gap = same_or_near_tie(model, prompt, [best, 7], [worst, 8])
        finally:
            model.lm_head.weight.copy_(saved)
    assert ok and gap == 0.0
    assert same_or_near_tie(model, prompt, [best], [best, 7])[0] is False  # stopped at different lengths


def test_greedy_runs_sort_identical_near_ties_and_real_partings(tiny):
    from lab_utils.checks.teacher_forced import compare_greedy_runs

    model, _ = tiny
    prompt = [5, 17, 99, 3]
    logits = score(model, prompt)[-1]
    best, worst = int(logits.argmax()), int(logits.argmin())
    prompts = {"same": prompt, "real": prompt}
    runs = compare_greedy_runs(model, prompts, {"same": [best, 7], "real": [best, 7]},
                               {"same": [best, 7], "real": [worst, 7]})
    assert (runs.total, runs.identical, runs.near_ties) == (2, 1, {}) and list(runs.partings) == ["real"]
    assert not runs.ok and "1 parted where the model was sure: real" in runs.describe()
    assert compare_greedy_runs(model, {"same": prompt}, {"same": [best]}, {"same": [best]}).ok
    with pytest.raises(ValueError, match="different requests"):
        compare_greedy_runs(model, prompts, {"same": [best]}, {"real": [best]})
