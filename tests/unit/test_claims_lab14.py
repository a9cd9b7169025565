"""Negative controls for lab 14's claims: real runs of the lab's trace code on a tiny model pass; a tier that
corrupts the K/V it copies back, a leaked block, a tier with no room, a prediction that misses and a run
without the learner's promote each fail their claim. Timing that the rounds cannot resolve is NOT JUDGED."""
from __future__ import annotations

import os
import random

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lab_utils import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from lab_utils.checks import lab14  # noqa: E402
from lab_utils.kvstore import returning  # noqa: E402

BS = 8
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def _trace() -> list[returning.TraceTurn]:
    """3 conversations of 3 turns: a shared system prompt, then each turn adds a reply and a message."""
    rng = random.Random(0)
    toks = lambda n: [rng.randrange(1, 200) for _ in range(n)]  # noqa: E731
    system, prompts = toks(16), []
    for _ in range(3):
        history, turns = system + toks(40), []
        for _ in range(3):
            ask = toks(6)
            turns.append(tuple(history + ask))
            history = history + ask + toks(20)
        prompts.append(turns)
    return returning.round_robin(["a", "b", "c"], prompts)


def _run(model, tier_blocks: int | None, corrupt: bool = False, leak: bool = False) -> tuple[list, str, dict]:
    trace = _trace()
    blocks = -(-max(len(t.prompt) for t in trace) // BS) + 2
    probe = LLMEngine(model, EngineConfig(block_size=BS, num_gpu_blocks=blocks), device="cpu")
    eng = LLMEngine(model, EngineConfig(block_size=BS, num_gpu_blocks=blocks, max_num_batched_tokens=256,
                                        watermark=0.0, kv_offload_bytes=tier_blocks and tier_blocks * probe.bytes_per_block),
                    device="cpu")
    if corrupt:  # the copy back writes garbage (a constant far outside the K/V's range) instead of the saved K/V
        tier = eng.block_manager.host_tier
        restore = tier.copy_in
        tier.copy_in = lambda bid, saved: restore(bid, {k: torch.full_like(v, 50.0) if v.is_floating_point() else v
                                                        for k, v in saved.items()})
    rows = returning.run_trace(eng, trace, PARAMS)
    if leak:
        eng.block_manager.take_block()
    return rows, returning.leak_report(eng), eng.stats()


@pytest.fixture(scope="module")
def runs(tiny64) -> dict:
    return {"off": _run(tiny64, None), "lru": _run(tiny64, 64)}


def _r(runs: dict, **override) -> dict:
    r = dict(tokens={s: [x.token_ids for x in rows] for s, (rows, _, _) in runs.items()},
             leaks={s: leak for s, (_, leak, _) in runs.items()},
             returning_prefill={s: sum(x.computed_tokens for x in returning.returning(rows))
                                for s, (rows, _, _) in runs.items()},
             ratio_measured={"lru": 2.3}, ratio_predicted={"lru": 2.5}, ratio_spread={"lru": 0.2},
             calls={"block_manager.promote": 12})
    r.update(override)
    return r


def test_the_real_runs_pass(runs, capsys):
    rows = runs["lru"][0]
    assert sum(x.host_tokens for x in rows) > 0, "the trace must bring blocks back from the tier"
    lab14.assert_claims(_r(runs))
    assert "FAIL" not in capsys.readouterr().out


def test_a_tier_that_corrupts_the_kv_changes_the_tokens(runs, tiny64):
    bad = {**runs, "lru": _run(tiny64, 64, corrupt=True)}
    with pytest.raises(AssertionError, match="greedy outputs identical"):
        lab14.assert_claims(_r(bad), show=False)


def test_a_leaked_block_fails(runs, tiny64):
    bad = {**runs, "lru": _run(tiny64, 64, leak=True)}
    with pytest.raises(AssertionError, match="no KV block leaked"):
        lab14.assert_claims(_r(bad), show=False)


def test_a_tier_that_holds_nothing_saves_no_prefill(runs, tiny64):
    bad = {**runs, "lru": _run(tiny64, 0)}  # kv_offload_bytes=0: no tier at all
    with pytest.raises(AssertionError, match="prefill fewer tokens"):
        lab14.assert_claims(_r(bad), show=False)


def test_a_prediction_that_misses_fails_and_a_noisy_one_is_not_judged(runs, capsys):
    with pytest.raises(AssertionError, match="predict within"):
        lab14.assert_claims(_r(runs, ratio_predicted={"lru": 4.0}), show=False)
    claims = lab14.claims(_r(runs, ratio_predicted={"lru": 4.0}, ratio_spread={"lru": 0.9}))
    text, ok = next(c for c in claims if "predict within" in c[0])
    assert ok is None and "NOT JUDGED" in text


def test_a_run_without_the_learners_promote_fails(runs):
    with pytest.raises(AssertionError, match="never called"):
        lab14.assert_claims(_r(runs, calls={}), show=False)


def test_tier_books_that_do_not_add_up_are_a_leak(tiny64):
    trace = _trace()[:3]
    eng = LLMEngine(tiny64, EngineConfig(block_size=BS, num_gpu_blocks=16, kv_offload_bytes=1 << 20), device="cpu")
    returning.run_trace(eng, trace, PARAMS)
    assert returning.leak_report(eng) == ""
    eng.block_manager.host_tier.bytes_used += 1
    assert "host tier" in returning.leak_report(eng)


def test_a_parting_counts_only_when_it_is_a_near_tie(runs):
    bad = _r(runs)
    bad["tokens"]["lru"] = [list(t) for t in bad["tokens"]["lru"]]
    bad["tokens"]["lru"][3] = bad["tokens"]["lru"][3][:-1] + [0]
    with pytest.raises(AssertionError, match="greedy outputs identical"):
        lab14.assert_claims(bad, show=False)
    lab14.assert_claims({**bad, "near_ties": {"lru": 1}}, show=False)
