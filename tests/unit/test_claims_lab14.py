"""Negative controls for lab 14's claims: real runs of the lab's trace code on a tiny model pass; a tier that
corrupts the K/V it copies back, a leaked block, a tier with no room, a prediction that misses and a run
without the learner's promote each fail their claim. Timing that the rounds cannot resolve is NOT JUDGED.
The shared store's claims: two real pools of prefill worker processes (with the store, without) pass; a store
with no room, a store that hands back wrong K/V, a leaked block and a store that slows every turn fail theirs."""
from __future__ import annotations

import os
import random

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lab_utils import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from lab_utils.checks import lab14  # noqa: E402
from lab_utils.kvstore import returning, routing, sources  # noqa: E402
from lab_utils.kvstore.tier import stable_names  # noqa: E402

BS = 8
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def _trace(seed: int = 0, prefix: str = "") -> list[returning.TraceTurn]:
    """3 conversations of 3 turns: a shared system prompt, then each turn adds a reply and a message."""
    rng = random.Random(seed)
    toks = lambda n: [rng.randrange(1, 200) for _ in range(n)]  # noqa: E731
    system, prompts = toks(16), []
    for _ in range(3):
        history, turns = system + toks(40), []
        for _ in range(3):
            ask = toks(6)
            turns.append(tuple(history + ask))
            history = history + ask + toks(20)
        prompts.append(turns)
    return returning.round_robin([f"{prefix}a", f"{prefix}b", f"{prefix}c"], prompts)


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


# -- the shared store: two prefill workers per pool, in processes of their own --------------------------------
STORE_CFG = EngineConfig(num_gpu_blocks=64, block_size=BS, enable_prefix_caching=True, max_num_seqs=2)


def _store_trace(seed: int) -> list[returning.TraceTurn]:
    return _trace(seed, prefix=str(seed))


def _poison(pool, trace, tiny64) -> int:
    """Put K/V of the right shape but wrong values (all 50.0) in `pool`'s store under every full block of
    `trace`'s prompts, before any worker computes them: a store that hands back someone else's K/V."""
    from lab_utils.engine.engine import copy_block_out
    from lab_utils.kvstore.tier import encode, stable_names

    shape = copy_block_out(LLMEngine(tiny64, STORE_CFG, device="cpu").kv_cache, 0)
    bad = encode({k: torch.full_like(v, 50.0) for k, v in shape.items()})
    client, n = pool.store.client(), 0
    for t in trace:
        for i, name in enumerate(stable_names(list(t.prompt), BS)):
            n += client.put(name, tuple(t.prompt[i * BS:(i + 1) * BS]), bad)
    client.close()
    return n


@pytest.fixture(scope="module")
def store_runs(tiny64) -> dict:
    """Pools started together: the store, none, and a store too small for one block; lab 14's routing over a
    trace; then a second trace on the store pool after wrong K/V was put in the store under its names."""
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import ExitStack

    from lab_utils.kvstore.workers import PrefillWorkers

    kinds = {"store": {}, "apart": {"use_store": False}, "full": {"store_bytes": 1}}
    with ExitStack() as stack, ThreadPoolExecutor(len(kinds)) as ex:
        futures = {k: ex.submit(PrefillWorkers, "tiny-random", STORE_CFG, dtype="float64", **kw)
                   for k, kw in kinds.items()}
        pools = {k: stack.enter_context(f.result()) for k, f in futures.items()}
        main = sources.route_to_other_worker(pools, _store_trace(0))
        poisoned_trace = _store_trace(1)
        assert _poison(pools["store"], poisoned_trace, tiny64) > 0
        poisoned = sources.route_to_other_worker({k: pools[k] for k in ("store", "apart")}, poisoned_trace)
    return {"main": main, "poisoned": poisoned}


def _store(rows, shared: str = "store") -> dict:
    r = sources.summarise(rows, BS, shared=shared)
    r["store_computed"] = {"store": r["store_computed"][shared], "apart": r["store_computed"]["apart"]}
    r["store_first_tokens"] = {"store": r["store_first_tokens"][shared], "apart": r["store_first_tokens"]["apart"]}
    r["store_ratios"] = [1.4, 1.3, 1.5]  # a tiny model's prefill is cheaper than a store call: timing apart
    return r


def _r(runs: dict, store: dict | None = None, routing: dict | None = None, **override) -> dict:
    r = dict(**(routing or ROUTING_OK), **(store or STORE_OK), tokens={s: [x.token_ids for x in rows] for s, (rows, _, _) in runs.items()},
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


STORE_OK = {"store_computed": {"store": 10, "apart": 30}, "store_read": 20,
            "store_first_tokens": {"store": [1, 2], "apart": [1, 2]},
            "store_leaks": {"store worker 0": "", "store worker 1": ""}, "store_ratios": [1.3]}


@pytest.mark.slow  # worker processes start: ~10 s each on a busy machine
def test_the_real_store_run_passes(runs, store_runs, capsys):
    rows = store_runs["main"]
    ret = sources.returning_turns(rows)
    assert ret and all(r.worker != (r.turn - 1) % 2 for r in ret), "a returning turn must land on the other worker"
    assert all(r.sources("store", BS).store > 0 for r in ret), "every returning turn reads its last turn from the store"
    assert all(r.sources("apart", BS).store == 0 for r in ret)
    assert all(r.sources(p, BS).prompt_tokens == r.prompt_tokens for r in rows for p in r.answers)
    traffic = sources.store_traffic(rows, "store")
    assert traffic["store_bytes_in"] > 0 and traffic["store_bytes_out"] > traffic["store_bytes_in"]
    lab14.assert_claims(_r(runs, _store(rows)))
    assert "FAIL" not in capsys.readouterr().out


@pytest.mark.slow  # worker processes start: ~10 s each on a busy machine
def test_a_store_with_no_room_saves_no_prefill(runs, store_runs):
    r = _store(store_runs["main"], shared="full")  # 1 byte: every block refused
    assert r["store_read"] == 0
    with pytest.raises(AssertionError, match="compute fewer prompt tokens"):
        lab14.assert_claims(_r(runs, r), show=False)


@pytest.mark.slow  # worker processes start: ~10 s each on a busy machine
def test_a_store_that_hands_back_wrong_kv_changes_first_tokens(runs, store_runs):
    r = _store(store_runs["poisoned"])
    with pytest.raises(AssertionError, match="first tokens identical"):
        lab14.assert_claims(_r(runs, r), show=False)


@pytest.mark.slow  # worker processes start: ~10 s each on a busy machine
def test_a_leaked_block_on_a_worker_fails(runs, store_runs, tiny64):
    from lab_utils.kvstore.store import KVStoreProcess
    from lab_utils.kvstore.tier import attach

    with KVStoreProcess(1 << 20) as store:  # what a worker runs: an engine with the store attached
        eng = LLMEngine(tiny64, STORE_CFG, device="cpu")
        attach(eng, store.client(), publish=True)
        eng.generate([list(_store_trace(2)[0].prompt)], PARAMS)
        assert returning.leak_report(eng) == ""
        eng.block_manager.take_block()
        leaked = returning.leak_report(eng)
    r = _store(store_runs["main"])
    r["store_leaks"] = {**r["store_leaks"], "store worker 1": leaked}
    with pytest.raises(AssertionError, match="no KV block leaked on any prefill worker"):
        lab14.assert_claims(_r(runs, r), show=False)
    r["store_leaks"] = {}  # no worker reported at all
    with pytest.raises(AssertionError, match="no KV block leaked on any prefill worker"):
        lab14.assert_claims(_r(runs, r), show=False)


def test_a_store_slower_than_recomputing_fails_and_a_noisy_one_is_not_judged(runs):
    with pytest.raises(AssertionError, match="faster with the store"):
        lab14.assert_claims(_r(runs, {**STORE_OK, "store_ratios": [0.8, 0.9, 0.7]}), show=False)
    claims = lab14.claims(_r(runs, {**STORE_OK, "store_ratios": [0.5, 1.5, 1.2]}))
    text, ok = next(c for c in claims if "faster with the store" in c[0])
    assert ok is None and "NOT JUDGED" in text


def test_a_missed_prediction_read_off_a_bumpy_prefill_curve_is_not_judged(runs):
    bumpy = {"fresh round 0": [(16, 0.010), (64, 0.030)], "tail round 0": [(16, 0.020), (64, 0.012)]}
    claims = lab14.claims(_r(runs, ratio_predicted={"lru": 4.0}, prefill_curves=bumpy))
    text, ok = next(c for c in claims if "predict within" in c[0])
    assert ok is None and "prefill curve the prediction reads is not increasing" in text and "tail round 0" in text
    smooth = {"fresh round 0": [(16, 0.010), (64, 0.030)]}
    text, ok = next(c for c in lab14.claims(_r(runs, ratio_predicted={"lru": 4.0}, prefill_curves=smooth))
                    if "predict within" in c[0])
    assert ok is False, text


# -- two replicas behind a router (section 6) -------------------------------------------------------------------
ROUTING_OK = {"routing_computed": {"round-robin": 30, "prefix-aware": 10},
              "routing_tokens": {"round-robin": [[1, 2]], "prefix-aware": [[1, 2]]},
              "routing_leaks": {"replica 0": "", "replica 1": ""}}


class _OtherReplica(routing.PrefixAware):
    """A router that gets prefix-aware routing backwards: every request to the replica it believes holds the
    least of its prefix."""

    def choose(self, prompt):
        names = stable_names(list(prompt), self.block_size)
        worst = min(range(self.num_replicas), key=lambda r: (self.matched_blocks(r, names), r))
        return worst, 0


def _routed(tiny64, router_cls, leak: bool = False) -> tuple[list, dict]:
    engines = [LLMEngine(tiny64, STORE_CFG, device="cpu") for _ in range(2)]
    rows = routing.run(engines, _trace(3), PARAMS, router_cls(2, BS, STORE_CFG.num_gpu_blocks))
    if leak:
        engines[1].block_manager.take_block()
    return rows, {f"replica {i}": returning.leak_report(e) for i, e in enumerate(engines)}


def _routing_r(rr, pa) -> dict:
    (rr_rows, rr_leaks), (pa_rows, pa_leaks) = rr, pa
    return {"routing_computed": {"round-robin": routing.summary(rr_rows)["computed"],
                                 "prefix-aware": routing.summary(pa_rows)["computed"]},
            "routing_tokens": {"round-robin": [x.token_ids for x in rr_rows],
                               "prefix-aware": [x.token_ids for x in pa_rows]},
            "routing_leaks": {**{f"rr {k}": v for k, v in rr_leaks.items()},
                              **{f"pa {k}": v for k, v in pa_leaks.items()}}}


def _round_robin(n, *_):
    return routing.RoundRobin(n)


def test_routing_by_prefix_passes_and_computes_less(runs, tiny64, capsys):
    rr, pa = _routed(tiny64, _round_robin), _routed(tiny64, routing.PrefixAware)
    s = routing.summary(pa[0])
    assert s["expected_right"] == s["returning_turns"], "the router's index must never promise more than is cached"
    lab14.assert_claims(_r(runs, routing=_routing_r(rr, pa)))
    assert "FAIL" not in capsys.readouterr().out


def test_a_router_that_sends_turns_away_from_their_prefix_fails(runs, tiny64):
    rr, away = _routed(tiny64, _round_robin), _routed(tiny64, _OtherReplica)
    with pytest.raises(AssertionError, match="compute fewer prompt tokens than routed round-robin"):
        lab14.assert_claims(_r(runs, routing=_routing_r(rr, away)), show=False)


def test_routing_with_changed_tokens_or_a_leaked_replica_fails(runs, tiny64):
    rr, pa = _routed(tiny64, _round_robin), _routed(tiny64, routing.PrefixAware, leak=True)
    r = _routing_r(rr, pa)
    with pytest.raises(AssertionError, match="no KV block leaked on any replica"):
        lab14.assert_claims(_r(runs, routing=r), show=False)
    r = {**ROUTING_OK, "routing_tokens": {"round-robin": [[1, 2]], "prefix-aware": [[1, 3]]}}
    with pytest.raises(AssertionError, match="identical under both routers"):
        lab14.assert_claims(_r(runs, routing=r), show=False)
    lab14.assert_claims(_r(runs, routing={**r, "routing_near_ties": 1}), show=False)


def test_the_router_refuses_bad_settings():
    with pytest.raises(ValueError, match="threshold"):
        routing.PrefixAware(2, 16, 64, threshold=1.5)
    with pytest.raises(ValueError, match="num_replicas"):
        routing.RoundRobin(0)
    with pytest.raises(ValueError, match="2 engines for a router over 3"):
        routing.run([object(), object()], [], PARAMS, routing.RoundRobin(3))
