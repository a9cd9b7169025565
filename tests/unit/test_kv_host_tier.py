"""The host tier under the prefix cache (`EngineConfig.kv_offload_bytes`, `lab_utils.engine.kv.host_tier`): a
conversation whose prefix the small device pool evicted comes back and copies its blocks back instead of
recomputing them, with the same greedy tokens; every block comes back, the tier stays within its bytes and
drops its least recently used entry first."""
from __future__ import annotations

import os
import random

import pytest
import torch

from lab_utils import EngineConfig, LLMEngine, SamplingParams
from lab_utils.engine.config import KV_OFFLOAD_POLICIES
from lab_utils.engine.kv.host_tier import POLICIES, HostTier, LRUPolicy, TwoQueuePolicy

BS = 8
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _conversations() -> tuple[list[int], list[list[int]], list[int]]:
    """Chat A's first turn, three other chats that push it out of the pool, and A's new user message."""
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(1, 200) for _ in range(n)]  # noqa: E731
    return tokens(80), [tokens(80) for _ in range(3)], tokens(12)


def _run(model, num_blocks: int, offload_bytes: int | None, kv_cache_dtype: str = "auto", policy: str = "lru") -> dict:
    """A's first turn, the others, then A's second turn (its first turn, A's reply, a new message), one at a time."""
    first, others, message = _conversations()
    eng = LLMEngine(model, EngineConfig(block_size=BS, num_gpu_blocks=num_blocks, max_num_batched_tokens=256,
                                        kv_cache_dtype=kv_cache_dtype, kv_offload_bytes=offload_bytes,
                                        kv_offload_policy=policy), device="cpu")
    outs = [eng.generate([p], GREEDY)[0] for p in [first, *others]]
    again = first + outs[0].token_ids + message
    logged = len(eng.step_log)
    second = eng.generate([again], GREEDY)[0]
    computed = sum(n for s in eng.step_log[logged:] for rid, n in s["requests"] if rid == second.request_id)
    eng.block_manager.check_all_free()
    return {"tokens": [o.token_ids for o in outs] + [second.token_ids], "cached": second.num_cached_tokens,
            "computed": computed - len(second.token_ids) + 1,  # prefill positions: all but the decode steps
            "prompt": len(again), "stats": eng.stats(), "engine": eng}


@pytest.fixture(scope="module")
def runs(tiny64) -> dict:
    small = 26  # blocks: one chat's turn (11-14 blocks) fits, A's prefix does not survive three others
    probe = LLMEngine(tiny64, EngineConfig(block_size=BS, num_gpu_blocks=small), device="cpu")
    tier = 64 * probe.bytes_per_block
    return {"off": _run(tiny64, small, None), "tier": _run(tiny64, small, tier), "big": _run(tiny64, 256, None),
            "2q": _run(tiny64, small, tier, policy="2q"), "tier_bytes": tier}


def test_returning_conversation_skips_its_prefill_with_the_tier(runs):
    off, tier, big = runs["off"], runs["tier"], runs["big"]
    # negative control: without the tier the small pool lost A's prefix, the big pool kept it
    assert off["cached"] == 0 and off["computed"] == off["prompt"], off
    assert big["cached"] >= 80, big
    # the tier brings back what the big pool kept: at least A's first turn, and far fewer tokens to compute
    assert tier["cached"] >= 80 and tier["computed"] <= tier["prompt"] // 4, (tier["cached"], tier["computed"])
    assert tier["stats"]["host_tier_hits"] * BS >= 80 and tier["stats"]["host_tier_blocks_out"] > 0
    assert tier["stats"]["host_tier_bytes_in"] == tier["stats"]["host_tier_hits"] * tier["engine"].bytes_per_block
    assert off["stats"]["host_tier_hits"] == 0 and off["stats"]["host_tier_blocks_out"] == 0
    # the same greedy tokens with the tier, without it, and with a pool that never evicts
    assert tier["tokens"] == off["tokens"] == big["tokens"] == runs["2q"]["tokens"]
    assert runs["2q"]["cached"] == tier["cached"]
    print(f"\nA's second turn ({tier['prompt']} prompt tokens): prefill computed {off['computed']} without the "
          f"tier, {tier['computed']} with it ({tier['cached']} cached), {big['computed']} with a big pool")


def test_every_block_comes_back_and_the_tier_stays_within_its_bytes(runs):
    tier = runs["tier"]
    bm = tier["engine"].block_manager
    bm.check_all_free()  # (also checked after each run)
    assert bm.host_tier.peak_bytes <= runs["tier_bytes"]
    assert bm.host_tier.bytes_used == sum(e.nbytes for e in bm.host_tier.entries.values())
    # every named block is in one place: the device cache or the host tier, never both
    assert not set(bm.hash_to_block) & set(bm.host_tier.entries)


def test_small_tier_drops_least_recently_offloaded_first(tiny64):
    """A tier of 3 blocks: offloading 5 keeps the last 3; a hit leaves the tier; a collision is a miss."""
    eng = LLMEngine(tiny64, EngineConfig(block_size=BS, num_gpu_blocks=8), device="cpu")
    tier = HostTier(3 * eng.bytes_per_block, lambda b: eng.kv_cache.copy_out([b]), lambda b, s: None,
                    policy=LRUPolicy())
    for name in range(5):
        tier.offload(name, name, (name,))
        assert tier.bytes_used <= tier.capacity_bytes
    assert list(tier.entries) == [2, 3, 4] and tier.dropped == 2
    assert tier.take(3, (99,)) is None, "same name, other tokens: a miss"
    assert tier.take(3, (3,)) is not None and 3 not in tier
    tier.offload(5, 5, (5,))
    tier.offload(6, 6, (6,))  # full again: 2 (the oldest) goes, 4 stays
    assert list(tier.entries) == [4, 5, 6]
    assert tier.stats()["host_tier_blocks_out"] == 7 and tier.stats()["host_tier_hits"] == 1


@pytest.mark.parametrize("policy, kept", [(LRUPolicy, [3, 4, 5]), (TwoQueuePolicy, [0, 4, 5])])
def test_two_queue_keeps_a_prefix_that_came_back_where_lru_drops_it(tiny64, policy, kept):
    """Block 0 comes back once and is offloaded again; then one-off blocks pass through a tier of 3. LRU drops 0
    as the oldest; 2Q keeps it (it returned before) and drops the one-offs."""
    eng = LLMEngine(tiny64, EngineConfig(block_size=BS, num_gpu_blocks=8), device="cpu")
    tier = HostTier(3 * eng.bytes_per_block, lambda b: eng.kv_cache.copy_out([b]), lambda b, s: None, policy())
    tier.offload(0, 0, (0,))
    assert tier.take(0, (0,)) is not None
    tier.offload(0, 0, (0,))
    for name in range(1, 6):
        tier.offload(name, name, (name,))
        assert tier.bytes_used <= tier.capacity_bytes
    assert sorted(tier.entries) == kept


def test_every_policy_the_config_names_exists():
    assert set(POLICIES) == set(KV_OFFLOAD_POLICIES)
    with pytest.raises(ValueError, match="kv_offload_policy='mru' is invalid"):
        EngineConfig(kv_offload_bytes=1 << 20, kv_offload_policy="mru")


def test_a_block_bigger_than_the_tier_is_not_kept(tiny64):
    eng = LLMEngine(tiny64, EngineConfig(block_size=BS, num_gpu_blocks=4), device="cpu")
    tier = HostTier(eng.bytes_per_block - 1, lambda b: eng.kv_cache.copy_out([b]), lambda b, s: None)
    tier.offload(0, 0, (0,))
    assert len(tier) == 0 and tier.bytes_used == 0


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_caches_come_back_bit_for_bit(tiny64, kv_cache_dtype):
    """int8 (values and scales) and fp8 blocks go to the host tier and back: the same tokens as without it."""
    small = 26
    probe = LLMEngine(tiny64, EngineConfig(block_size=BS, num_gpu_blocks=small, kv_cache_dtype=kv_cache_dtype),
                      device="cpu")
    off = _run(tiny64, small, None, kv_cache_dtype)
    tier = _run(tiny64, small, 64 * probe.bytes_per_block, kv_cache_dtype)
    assert off["cached"] == 0 and tier["cached"] >= 80
    assert tier["tokens"] == off["tokens"]
    if kv_cache_dtype == "int8":  # the scales travel too: an entry is values and scales
        entry = next(iter(tier["engine"].block_manager.host_tier.entries.values()), None)
        assert entry is None or {"k_scale", "v_scale"} <= set(entry.saved)
    assert tier["stats"]["host_tier_bytes_out"] % probe.bytes_per_block == 0


def test_copy_out_and_in_restore_a_block_exactly(tiny64):
    eng = LLMEngine(tiny64, EngineConfig(block_size=BS, num_gpu_blocks=4, kv_cache_dtype="int8"), device="cpu")
    kv = eng.kv_cache
    for t in (kv.k, kv.v, kv.k_scale, kv.v_scale):
        t.copy_(torch.randint(-100, 100, t.shape).to(t.dtype))
    before = {n: getattr(kv, n).clone() for n in ("k", "v", "k_scale", "v_scale")}
    tier = HostTier(1 << 20, lambda b: kv.copy_out([b]), lambda b, s: kv.copy_in([b], s))
    tier.offload(1, "x", (1,))
    for n in before:
        getattr(kv, n)[:, BS:2 * BS].zero_()
    tier.restore(2, tier.take("x", (1,)))  # into another block
    for n, t in before.items():
        assert torch.equal(getattr(kv, n)[:, 2 * BS:3 * BS], t[:, BS:2 * BS]), n


def test_config_refuses_a_negative_size():
    with pytest.raises(ValueError, match=r"kv_offload_bytes=-1 is invalid: must be None \(off\) or an int >= 0"):
        EngineConfig(kv_offload_bytes=-1)
    with pytest.raises(ValueError, match="prefix cache is off"):
        EngineConfig(kv_offload_bytes=1 << 20, enable_prefix_caching=False)
    assert EngineConfig(kv_offload_bytes=0).kv_offload_bytes == 0  # 0: off, as None


def test_cli_flag_is_in_gib_as_vllm():
    import argparse

    from lab_utils.engine.cli import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--kv-offloading-size", "0.5"])).kv_offload_bytes == 1 << 29
    assert engine_config_from_args(parser.parse_args([])).kv_offload_bytes is None


def test_learner_prefix_cache_parts_are_refused_with_the_tier(tiny64):
    from lab_utils.course.parts import EngineParts
    from lab_utils.engine.kv.block_manager import BlockManager

    def match_prefix(self, req):
        return BlockManager.match_prefix(self, req)

    parts = EngineParts({"block_manager.match_prefix": match_prefix})
    with pytest.raises(ValueError, match="learner's block_manager.match_prefix"):
        LLMEngine(tiny64, EngineConfig(block_size=BS, num_gpu_blocks=8, kv_offload_bytes=1 << 20), device="cpu",
                  parts=parts)
    LLMEngine(tiny64, EngineConfig(block_size=BS, num_gpu_blocks=8), device="cpu", parts=parts)  # tier off: runs


@pytest.mark.parametrize("preemption_mode, policy", [("recompute", "lru"), ("swap", "lru"), ("recompute", "2q")])
def test_concurrent_shared_prefixes_in_a_tiny_pool(tiny64, preemption_mode, policy):
    """Four at a time over a pool that preempts and evicts all the time, prompts sharing prefixes of several
    lengths, in two waves (the second returns to the first's prefixes): with the tier the same greedy tokens as
    without it, blocks found in the tier, every block back, the tier within its bytes."""
    rng = random.Random(1)
    heads = [[rng.randrange(1, 200) for _ in range(rng.choice([16, 24, 40]))] for _ in range(4)]
    prompts = [rng.choice(heads) + [rng.randrange(1, 200) for _ in range(rng.randrange(1, 12))] for _ in range(16)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    def run(offload_bytes):
        eng = LLMEngine(tiny64, EngineConfig(block_size=4, num_gpu_blocks=40, max_num_seqs=4,
                                             max_num_batched_tokens=32, preemption_mode=preemption_mode,
                                             kv_offload_bytes=offload_bytes, kv_offload_policy=policy),
                        device="cpu")
        out = [o.token_ids for o in eng.generate(prompts[:8], params) + eng.generate(prompts[8:], params)]
        eng.block_manager.check_all_free()
        return out, eng

    off, _ = run(None)
    probe = LLMEngine(tiny64, EngineConfig(block_size=4, num_gpu_blocks=4), device="cpu")
    budget = 12 * probe.bytes_per_block
    on, eng = run(budget)
    assert on == off
    tier = eng.block_manager.host_tier
    assert tier.hits > 0 and tier.peak_bytes <= budget
    assert not set(eng.block_manager.hash_to_block) & set(tier.entries)


def test_other_learner_block_manager_parts_run_with_the_tier(tiny64):
    """The tier needs the engine's own match_prefix and evict only: a learner's hash_block, commit_full_blocks,
    recycle, grow and release (the reference wrapped, so the engine runs it as a learner's, guards on) run with it."""
    import functools

    from lab_utils.course.parts import EngineParts
    from lab_utils.engine.kv.block_manager import BlockManager

    def wrap(attr):
        ref = getattr(BlockManager, attr)

        @functools.wraps(ref)
        def part(*args):
            return ref(*args)
        return part

    names = ("hash_block", "commit_full_blocks", "recycle", "grow", "release")
    parts = EngineParts({f"block_manager.{n}": wrap(n) for n in names})
    rng = random.Random(2)
    head = [rng.randrange(1, 200) for _ in range(24)]
    prompts = [head + [rng.randrange(1, 200) for _ in range(4)] for _ in range(2)]
    others = [[rng.randrange(1, 200) for _ in range(28)] for _ in range(3)]
    outs = []
    for offload in (None, 1 << 22):
        eng = LLMEngine(tiny64, EngineConfig(block_size=4, num_gpu_blocks=12, kv_offload_bytes=offload),
                        device="cpu", parts=parts)
        outs.append([eng.generate([p], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
                     for p in [prompts[0], *others, prompts[1]]])
        eng.block_manager.check_all_free()
    assert outs[0] == outs[1] and eng.stats()["host_tier_hits"] >= 6 and parts.calls["block_manager.recycle"]


def test_a_policy_that_names_an_entry_the_tier_lacks_is_stopped():
    """A policy left with a stale name (an entry taken out of `entries` behind its back) would make the tier drop
    nothing, forever: the tier refuses it, naming the policy."""
    store = {0: {"kv": torch.zeros(4)}, 1: {"kv": torch.ones(4)}}
    tier = HostTier(16, lambda b: {k: v.clone() for k, v in store[b].items()}, lambda b, s: None, LRUPolicy())
    tier.offload(0, "a", (1,))
    tier.entries.pop("a")  # behind the policy's back
    tier.bytes_used = 16
    with pytest.raises(RuntimeError, match="LRUPolicy chose 'a'"):
        tier.offload(1, "b", (2,))


def test_fuzz_host_and_disk_tiers_under_memory_pressure_keep_outputs_and_their_books(tiny64):
    """The engine's property test (shared prefixes, tight pool, chunked prefill, both preemption modes) with a host
    tier of a random size (none to plenty) and policy, a disk tier under it (none, tiny, plenty), the prefetch on
    or off, requests arriving together or a few steps apart, and sometimes one too big for the pool: every
    request finishes with the reference's greedy tokens or is rejected, every device block comes back, and each
    tier's books match its entries (bytes, the policy's names, the disk's slots; nothing still reserved)."""
    from hypothesis import example, given, settings
    from hypothesis import strategies as st
    from test_engine_properties import MAX_MODEL_LEN, SETTINGS, reference, tight_pool, workloads

    from lab_utils.kvstore.returning import leak_report

    hits = {"examples": 0, "host": 0, "disk": 0, "prefetch": 0, "rejected": 0}
    # whatever hypothesis draws, a workload whose shared prefix surely goes down to the disk tier and comes back
    system = list(range(1000, 1040))
    sure = ([system + [7, 8, 9], [50 + i for i in range(40)], [90 + i for i in range(41)], system + [10, 11],
             system + [12]], [4, 4, 4, 4, 4])
    sure_kw = dict(work=sure, mode="recompute", budget=40, slack=0, block_size=4, tier_blocks=1, policy="lru",
                   disk_blocks=64, apart=0, too_big=False)

    @settings(SETTINGS, max_examples=24)
    @example(**{**sure_kw, "prefetch": False})
    @example(**{**sure_kw, "prefetch": True, "apart": 8, "mode": "swap", "tier_blocks": 4})
    @given(work=workloads(shared_prefix=True), mode=st.sampled_from(["recompute", "swap"]),
           budget=st.sampled_from([8, 16, 40]), slack=st.integers(0, 3), block_size=st.sampled_from([4, 8]),
           tier_blocks=st.sampled_from([1, 2, 4, 64]), policy=st.sampled_from(sorted(POLICIES)),
           disk_blocks=st.sampled_from([0, 1, 3, 64]), prefetch=st.booleans(), apart=st.sampled_from([0, 0, 2, 8]),
           too_big=st.booleans())
    def prop(work, mode, budget, slack, block_size, tier_blocks, policy, disk_blocks, prefetch, apart, too_big):
        prompts, max_tokens = work
        ref = reference(tiny64, prompts, max_tokens)
        blocks = tight_pool(prompts, max_tokens, block_size, slack)
        probe = LLMEngine(tiny64, EngineConfig(block_size=block_size, num_gpu_blocks=blocks, max_model_len=128),
                          device="cpu")
        per = probe.bytes_per_block
        eng = LLMEngine(tiny64, EngineConfig(
            num_gpu_blocks=blocks, block_size=block_size, preemption_mode=mode,
            max_num_batched_tokens=max(budget, block_size), enable_prefix_caching=True, watermark=0.0,
            max_model_len=MAX_MODEL_LEN, kv_offload_bytes=tier_blocks * per, kv_offload_policy=policy,
            kv_offload_disk_bytes=disk_blocks * (per + 64 * 4) or None, kv_offload_prefetch=prefetch), device="cpu")
        todo = [(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(prompts, max_tokens)]
        if too_big:  # needs more blocks than the pool has: rejected at once, never stuck
            todo.insert(len(todo) // 2, (prompts[0][:block_size] * 8, SamplingParams(max_tokens=blocks * block_size)))
        ids, outs, steps = [], {}, 0
        while todo or eng.has_unfinished():
            if todo and (apart == 0 or steps % apart == 0):
                ids.append(eng.add_request(*todo.pop(0)))
                if apart == 0:
                    continue
            outs.update((o.request_id, o) for o in eng.step() if o.finished)
            steps += 1
        got = [outs[i] for i in ids]
        rejected = [o for o in got if o.finish_reason.startswith("rejected")]
        assert len(rejected) == too_big, [o.finish_reason for o in got]
        assert [o.token_ids for o in got if o not in rejected] == ref
        assert all(o.finish_reason == "length" for o in got if o not in rejected)
        assert leak_report(eng) == ""
        assert eng.scheduler.num_running == 0 and not eng.scheduler.waiting
        disk = eng.block_manager.host_tier.disk
        st_ = eng.stats()
        hits["host"] += st_["host_tier_hits"]
        hits["disk"] += st_["disk_tier_hits"]
        hits["prefetch"] += st_["host_tier_prefetched"]
        hits["rejected"] += len(rejected)
        hits["examples"] += 1
        eng.close()
        assert disk is None or not os.path.exists(disk.dir)

    prop()
    print(f"\nover the examples: {hits}")
    assert hits["host"] > 0 and hits["disk"] > 0 and hits["prefetch"] > 0 and hits["rejected"] > 0, hits
