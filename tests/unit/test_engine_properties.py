"""Property-based tests of the engine (hypothesis): whatever the workload and the memory pressure, every request
finishes, greedy outputs equal an unpreempted, unchunked, uncached run, and all KV blocks come back.

The model is `tiny-random` in float64, so a different batch composition can never flip a greedy argmax through
rounding: any difference is a real bug (wrong positions, a stale block, a lost token).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lab_utils import EngineConfig, LLMEngine, SamplingParams
from lab_utils.engine.request import Status

MAX_MODEL_LEN = 128
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def tiny(tiny64):
    """`load_model("tiny-random", device="cpu", dtype=torch.float64)`, shared with the other engine tests."""
    assert tiny64[0].dtype == torch.float64
    return tiny64


@st.composite
def workloads(draw, shared_prefix: bool = False):
    """(prompts, max_tokens per request). With `shared_prefix`, prompts start with one of two system prompts."""
    n = draw(st.integers(2, 6))
    tok = st.integers(100, 49_000)
    systems = [draw(st.lists(tok, min_size=8, max_size=40)) for _ in range(2)] if shared_prefix else [[]]
    prompts, max_tokens = [], []
    for _ in range(n):
        head = systems[draw(st.integers(0, len(systems) - 1))]
        prompts.append(head + draw(st.lists(tok, min_size=1, max_size=30)))
        max_tokens.append(draw(st.integers(1, 16)))
    return prompts, max_tokens


def run(model_tok, prompts, max_tokens, **cfg) -> tuple[LLMEngine, list[list[int]]]:
    cfg.setdefault("max_model_len", MAX_MODEL_LEN)
    eng = LLMEngine(model_tok, EngineConfig(**cfg), device="cpu")
    outs = eng.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens])
    assert all(o.finished and o.finish_reason == "length" for o in outs), [o.finish_reason for o in outs]
    assert [len(o.token_ids) for o in outs] == max_tokens
    assert all(r.status is Status.FINISHED for r in eng.requests.values())
    # leak check: every block has ref count zero and is free (or cached and evictable)
    eng.block_manager.check_all_free()
    assert all(b.ref_count == 0 for b in eng.block_manager.blocks)
    assert eng.scheduler.num_running == 0 and not eng.scheduler.waiting  # ended requests retire at the next step
    return eng, [o.token_ids for o in outs]


def reference(model_tok, prompts, max_tokens) -> list[list[int]]:
    """Plenty of memory, whole prompts in one step, no prefix cache: nothing is ever preempted or shared."""
    eng, out = run(model_tok, prompts, max_tokens, num_gpu_blocks=256, block_size=16, max_num_batched_tokens=4096,
                   enable_chunked_prefill=False, enable_prefix_caching=False, scheduler="continuous")
    assert eng.stats()["num_preemptions"] == 0
    return out


def tight_pool(prompts, max_tokens, block_size: int, slack: int) -> int:
    """Just enough blocks for the longest request alone (so each can finish), plus `slack`: far too few for all."""
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    return -(-longest // block_size) + slack


def test_preemption_keeps_outputs_and_frees_every_block(tiny):
    seen = {"recompute": 0, "swap": 0}

    @SETTINGS
    @given(work=workloads(), mode=st.sampled_from(["recompute", "swap"]), block_size=st.sampled_from([4, 8]),
           slack=st.integers(0, 2), scheduler=st.sampled_from(["token_budget", "continuous"]))
    def prop(work, mode, block_size, slack, scheduler):
        prompts, max_tokens = work
        ref = reference(tiny, prompts, max_tokens)
        eng, got = run(tiny, prompts, max_tokens, num_gpu_blocks=tight_pool(prompts, max_tokens, block_size, slack),
                       block_size=block_size, preemption_mode=mode, scheduler=scheduler, max_num_batched_tokens=64,
                       enable_prefix_caching=False, watermark=0.0)
        assert got == ref  # float64: other row counts/chunks move a logit by ~1e-15, below any greedy margin
        seen[mode] += eng.stats()["num_preemptions"]

    prop()
    # the pools were small enough that both preemption modes actually ran
    assert seen["recompute"] > 0 and seen["swap"] > 0, seen


def test_chunked_prefill_at_any_budget_keeps_outputs(tiny):
    @SETTINGS
    @given(work=workloads(), budget=st.sampled_from([16, 24, 48, 128]), chunked=st.booleans(),
           block_size=st.sampled_from([4, 16]))
    def prop(work, budget, chunked, block_size):
        prompts, max_tokens = work
        if not chunked:
            budget = max(budget, MAX_MODEL_LEN)  # a whole prompt must fit in one step
        ref = reference(tiny, prompts, max_tokens)
        eng, got = run(tiny, prompts, max_tokens, num_gpu_blocks=512 // block_size, block_size=block_size,
                       max_num_batched_tokens=budget, enable_chunked_prefill=chunked, scheduler="token_budget")
        assert got == ref  # float64: other row counts/chunks move a logit by ~1e-15, below any greedy margin
        assert max(s["num_tokens"] for s in eng.step_log) <= budget

    prop()


def test_prefix_caching_with_shared_prefixes_keeps_outputs(tiny):
    hits = []

    system = list(range(1000, 1040))  # 10 full blocks of 4 tokens shared by every prompt
    sure_hit = ([system + [7, 8, 9], system + [10, 11], system + [12]], [4, 4, 4])

    @SETTINGS
    @given(work=workloads(shared_prefix=True), caching=st.booleans(), budget=st.sampled_from([16, 32, 512]),
           max_num_seqs=st.sampled_from([1, 3, 8]))
    @example(work=sure_hit, caching=True, budget=512, max_num_seqs=1)  # whatever hypothesis draws, one sure hit
    def prop(work, caching, budget, max_num_seqs):
        prompts, max_tokens = work
        ref = reference(tiny, prompts, max_tokens)
        eng, got = run(tiny, prompts, max_tokens, num_gpu_blocks=64, block_size=4, max_num_batched_tokens=budget,
                       enable_prefix_caching=caching, max_num_seqs=max_num_seqs)
        assert got == ref  # float64: other row counts/chunks move a logit by ~1e-15, below any greedy margin
        rate = eng.stats()["prefix_cache_hit_rate"]
        assert rate == 0.0 if not caching else 0.0 <= rate <= 1.0
        if caching:
            hits.append(rate)

    prop()
    assert max(hits) > 0.3, "shared system prompts never hit the prefix cache"


def test_everything_at_once_under_memory_pressure(tiny):
    """Prefix caching + chunked prefill + preemption (both modes) + shared prefixes, in one tight pool."""
    seen = []

    @SETTINGS
    @given(work=workloads(shared_prefix=True), mode=st.sampled_from(["recompute", "swap"]),
           budget=st.sampled_from([8, 16, 40]), slack=st.integers(0, 3), block_size=st.sampled_from([4, 8]))
    def prop(work, mode, budget, slack, block_size):
        prompts, max_tokens = work
        budget = max(budget, block_size)
        ref = reference(tiny, prompts, max_tokens)
        eng, got = run(tiny, prompts, max_tokens, num_gpu_blocks=tight_pool(prompts, max_tokens, block_size, slack),
                       block_size=block_size, preemption_mode=mode, max_num_batched_tokens=budget,
                       enable_prefix_caching=True, watermark=0.0)
        assert got == ref  # float64: other row counts/chunks move a logit by ~1e-15, below any greedy margin
        seen.append(eng.stats()["num_preemptions"])

    prop()
    assert sum(seen) > 0, "no example was preempted: the pool was never tight"


# --- regressions found by the properties above (deterministic, so they fail fast) ----------------------------


def _shared_prefix_workload():
    system = [47639, 458, 15385] + [100] * 13
    prompts = [system + [5, 6, 7], system + [9], system + [100] * 3, system + [11], system + [12, 13]]
    return prompts, [13, 10, 12, 6, 9]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_with_prefix_cache_regression(tiny, mode):
    """A swapped-out request used to be admitted as if it would reuse cached prefix blocks (it brings its own
    KV instead), so `grow` failed with 'admission check and allocation disagree'."""
    prompts, max_tokens = _shared_prefix_workload()
    ref = reference(tiny, prompts, max_tokens)
    eng, got = run(tiny, prompts, max_tokens, num_gpu_blocks=9, block_size=4, preemption_mode=mode,
                   max_num_batched_tokens=8, watermark=0.0)
    assert got == ref
    assert eng.stats()["num_preemptions"] > 0 and eng.stats()["prefix_cache_hit_rate"] > 0


def test_request_larger_than_the_pool_is_rejected_not_stuck(tiny):
    """prompt + max_tokens that cannot fit even alone used to end in RuntimeError('...no progress...')."""
    eng = LLMEngine(tiny, EngineConfig(num_gpu_blocks=4, block_size=4, max_model_len=MAX_MODEL_LEN), device="cpu")
    ok, big = eng.generate([[101] * 5, [102] * 5], [SamplingParams(max_tokens=11, ignore_eos=True),
                                                    SamplingParams(max_tokens=12, ignore_eos=True)])
    assert ok.finish_reason == "length" and len(ok.token_ids) == 11
    assert big.finish_reason.startswith("rejected") and "KV blocks" in big.finish_reason
    eng.block_manager.check_all_free()
