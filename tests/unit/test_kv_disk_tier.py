"""The disk tier under the host tier (`EngineConfig.kv_offload_disk_bytes`, `lab_utils.engine.kv.disk_tier`), the
prefetch that reads a new request's disk blocks into the host tier before its admission, and the CUDA path of
the host tier's copies (pinned memory, a side stream): bounded bytes, least recently written dropped first, a
collision is a miss, K/V bytes come back bit for bit (fp32, int8 with its scales), the files go when the engine
closes, and greedy tokens are the same with the tiers on or off."""
from __future__ import annotations

import os
import random
import tempfile
import time

import pytest
import torch

from lab_utils import EngineConfig, LLMEngine, SamplingParams
from lab_utils.engine.kv.disk_tier import DiskTier
from lab_utils.engine.kv.host_tier import HostTier, LRUPolicy

BS = 8
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _block(value: float, int8: bool = False) -> dict[str, torch.Tensor]:
    if int8:
        return {"k": torch.full((2, BS, 1, 4), int(value), dtype=torch.int8),
                "v": torch.full((2, BS, 1, 4), -int(value), dtype=torch.int8),
                "k_scale": torch.full((2, BS, 1), value / 7, dtype=torch.float32),
                "v_scale": torch.full((2, BS, 1), value / 3, dtype=torch.float32)}
    return {"k": torch.full((2, BS, 1, 4), value), "v": torch.full((2, BS, 1, 4), -value)}


def test_disk_tier_is_bounded_drops_least_recently_written_and_guards_collisions(tmp_path):
    one = DiskTier(1 << 20, tmp_path)
    one.put("probe", (0,), _block(0.0))
    slot = one.layout.slot_bytes
    one.close()
    disk = DiskTier(3 * slot + slot // 2, tmp_path)  # room for 3 slots, not 4
    for name in range(5):
        assert disk.put(name, (name,), _block(float(name)))
        assert os.path.getsize(disk.path) <= disk.capacity_bytes
    assert list(disk.entries) == [2, 3, 4] and disk.dropped == 2 and disk.num_slots == 3
    assert disk.take(3, (99,)) is None, "same name, other tokens: a miss"
    got = disk.take(3, (3,))
    assert torch.equal(got["k"], _block(3.0)["k"]) and 3 not in disk
    disk.put(5, (5,), _block(5.0))
    disk.put(6, (6,), _block(6.0))  # full again: 2 (the oldest) goes
    assert list(disk.entries) == [4, 5, 6] and disk.books() == ""
    s = disk.stats()
    assert s["disk_tier_hits"] == 1 and s["disk_tier_blocks_out"] == 7 and s["disk_tier_bytes_in"] > 0
    assert s["disk_tier_bytes_out"] == 7 * sum(t.nbytes for t in _block(0.0).values())
    assert s["disk_tier_seconds_out"] > 0 and s["disk_tier_seconds_in"] > 0
    with pytest.raises(ValueError, match="layout"):
        disk.put(7, (7,), _block(7.0, int8=True))
    disk.close()


@pytest.mark.parametrize("int8", [False, True])
def test_disk_tier_round_trips_bytes(tmp_path, int8):
    disk = DiskTier(1 << 20, tmp_path)
    blocks = {name: _block(1.5 + name, int8) for name in range(4)}
    for name, saved in blocks.items():
        disk.put(name, (name,), saved)
    for name, saved in blocks.items():
        got = disk.take(name, (name,))
        assert set(got) == set(saved)
        for k in saved:
            assert got[k].dtype == saved[k].dtype and torch.equal(got[k], saved[k]), (name, k)
    assert disk.books() == "" and not disk.entries
    disk.close()


@pytest.mark.parametrize("kv_cache_dtype", ["fp32", "int8"])
def test_blocks_go_host_to_disk_and_back_into_the_cache_bit_for_bit(tiny64, tmp_path, kv_cache_dtype):
    """A host tier of one block over a disk tier: offloading three spills two to disk; taking one back from disk
    restores exactly the bytes the device held (an int8 cache's scales too)."""
    eng = LLMEngine(tiny64, EngineConfig(block_size=BS, num_gpu_blocks=6, kv_cache_dtype=kv_cache_dtype),
                    device="cpu")
    kv = eng.kv_cache
    names = ("k", "v", "k_scale", "v_scale") if kv.quantized else ("k", "v")
    for n in names:
        t = getattr(kv, n)
        t.copy_(torch.randint(-100, 100, t.shape).to(t.dtype) if t.dtype == torch.int8 else torch.randn(t.shape))
    before = {n: getattr(kv, n).clone() for n in names}
    disk = DiskTier(1 << 20, tmp_path)
    tier = HostTier(eng.bytes_per_block, lambda b: kv.copy_out([b]), lambda b, s: kv.copy_in([b], s), LRUPolicy(),
                    disk=disk)
    for b in (1, 2, 3):
        tier.offload(b, f"x{b}", (b,))
    assert list(tier.entries) == ["x3"] and list(disk.entries) == ["x1", "x2"] and tier.dropped == 2
    assert tier.holds("x1", (1,)) and not tier.holds("x1", (2,))
    for n in names:
        getattr(kv, n)[:, BS:4 * BS].zero_()
    tier.restore(5, tier.take("x1", (1,)))  # from disk, straight into device block 5
    tier.restore(4, tier.take("x3", (3,)))  # from host memory
    for n, t in before.items():
        assert torch.equal(getattr(kv, n)[:, 5 * BS:6 * BS], t[:, BS:2 * BS]), n
        assert torch.equal(getattr(kv, n)[:, 4 * BS:5 * BS], t[:, 3 * BS:4 * BS]), n
    assert disk.hits == 1 and tier.hits == 1 and tier.books() == ""
    tier.close()
    assert not os.path.exists(disk.dir)


def test_prefetch_reserves_its_blocks_until_release(tmp_path):
    """Blocks prefetched for a request are held for it: blocks the device evicts meanwhile go past them to the
    disk tier; after `release` they are ordinary entries, the policy's to drop; the books stay right."""
    store = {b: _block(float(b)) for b in range(10)}
    nbytes = sum(t.nbytes for t in store[0].values())
    disk = DiskTier(1 << 20, tmp_path)
    tier = HostTier(3 * nbytes, lambda b: {k: v.clone() for k, v in store[b].items()}, lambda b, s: None,
                    LRUPolicy(), disk=disk)
    for b in range(6):  # 0, 1, 2 go down to disk; 3, 4, 5 stay in host memory
        tier.offload(b, b, (b,))
    assert sorted(disk.entries) == [0, 1, 2] and sorted(tier.entries) == [3, 4, 5]
    assert tier.prefetch([(0, (0,)), (1, (1,)), (2, (2,)), (9, (9,))], owner="r") == 3  # 9 is nowhere
    tier.drain()
    assert sorted(tier.reserved["r"]) == [0, 1, 2] and sorted(disk.entries) == [3, 4, 5]  # made room: 3-5 down
    tier.offload(7, 7, (7,))  # only reserved entries to drop: 7 goes straight to disk
    assert sorted(tier.entries) == [0, 1, 2] and 7 in disk
    assert torch.equal(tier.take(0, (0,))["k"], store[0]["k"]) and tier.prefetch_hits == 1
    tier.offload(8, 8, (8,))  # the room 0 left
    tier.offload(6, 6, (6,))  # 8 is the only ordinary entry: it goes down, 1 and 2 stay
    assert sorted(tier.entries) == [1, 2, 6] and 8 in disk
    tier.release("r")
    assert not tier.reserved and tier.books() == ""
    tier.offload(3, 3, (3,))  # 1 and 2 joined the policy as its newest: 6 is the oldest, dropped to disk
    tier.offload(4, 4, (4,))  # then 1
    assert 6 in disk and 1 in disk and sorted(tier.entries) == [2, 3, 4] and tier.books() == ""
    tier.close()
    assert not os.path.exists(disk.dir)


def _conversations():
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(1, 200) for _ in range(n)]  # noqa: E731
    return tokens(80), [tokens(80) for _ in range(3)], tokens(12)


def _engine(model, host_blocks, disk_blocks, prefetch=True, kv_cache_dtype="auto", path=None) -> LLMEngine:
    probe = LLMEngine(model, EngineConfig(block_size=BS, num_gpu_blocks=4, kv_cache_dtype=kv_cache_dtype),
                      device="cpu")
    per = probe.bytes_per_block
    return LLMEngine(model, EngineConfig(
        block_size=BS, num_gpu_blocks=26, max_num_batched_tokens=256, kv_cache_dtype=kv_cache_dtype,
        kv_offload_bytes=host_blocks * per if host_blocks else None,
        kv_offload_disk_bytes=disk_blocks * per * 2 if disk_blocks else None,  # slots are aligned: some slack
        kv_offload_disk_path=path, kv_offload_prefetch=prefetch), device="cpu")


def _returning_turn(eng: LLMEngine, gap_steps: int = 0) -> dict:
    """A's first turn, three others that push it out of the pool, then A's second turn. With `gap_steps`, A's
    second turn is added while another request still runs for that many steps (time for the prefetch)."""
    first, others, message = _conversations()
    outs = [eng.generate([p], GREEDY)[0] for p in [first, *others]]
    again = first + outs[0].token_ids + message
    if gap_steps:
        busy = eng.add_request(others[0][:7], SamplingParams(max_tokens=gap_steps, ignore_eos=True))
        rid = eng.add_request(again, GREEDY)
        eng.scheduler.waiting.remove(eng.requests[rid])  # held back while `busy` runs: the add-to-admit gap
        while not eng.requests[busy].status.done:
            eng.step()
            time.sleep(0.01)
        eng.scheduler.waiting.append(eng.requests[rid])
        second = None
        while second is None:
            second = next((o for o in eng.step() if o.finished and o.request_id == rid), None)
    else:
        second = eng.generate([again], GREEDY)[0]
    return {"tokens": [o.token_ids for o in outs] + [second.token_ids], "cached": second.num_cached_tokens,
            "stats": eng.stats()}


@pytest.fixture(scope="module")
def turns(tiny64) -> dict:
    runs = {}
    for key, host, disk, prefetch, gap in [("off", 0, 0, False, 0), ("host", 4, 0, False, 0),
                                            ("disk", 4, 64, False, 0), ("disk_gap", 10, 64, False, 8),
                                            ("prefetch_gap", 10, 64, True, 8), ("prefetch_nogap", 10, 64, True, 0)]:
        eng = _engine(tiny64, host, disk, prefetch)
        runs[key] = _returning_turn(eng, gap)
        assert eng.block_manager.host_tier is None or eng.block_manager.host_tier.books() == ""
        eng.block_manager.check_all_free()
        eng.close()
    return runs


def test_the_disk_tier_brings_back_what_the_host_tier_dropped_with_the_same_tokens(turns):
    off, host, disk = turns["off"], turns["host"], turns["disk"]
    assert off["cached"] == 0 and host["cached"] < 80, "negative control: a 4-block host tier loses A's prefix"
    assert disk["cached"] >= 80 and disk["stats"]["disk_tier_hits"] > 0
    assert disk["stats"]["host_tier_dropped"] > 0 and disk["stats"]["disk_tier_blocks_out"] > 0
    assert all(r["tokens"] == off["tokens"] for r in turns.values())
    assert off["stats"]["disk_tier_hits"] == 0 and "disk_tier_seconds_in" in off["stats"]


def test_prefetch_turns_disk_hits_into_host_hits_when_there_is_time(turns):
    """The same returning turn, added while another request runs for 8 steps before it is admitted: without
    the prefetch its disk blocks are read at admission (disk hits); with it they were read meanwhile, and its
    lookup finds them in host memory (prefetch hits)."""
    sync, pre = turns["disk_gap"]["stats"], turns["prefetch_gap"]["stats"]
    assert sync["disk_tier_hits"] > 0 and sync["host_tier_prefetch_hits"] == 0
    # every block of A's prefix is a host hit: those read up ahead, and those already there (reserved too)
    assert pre["disk_tier_hits"] == 0 and pre["host_tier_prefetch_hits"] > 0
    assert pre["host_tier_hits"] == sync["host_tier_hits"] + sync["disk_tier_hits"]
    assert pre["host_tier_prefetched"] == pre["host_tier_prefetch_hits"]
    assert turns["prefetch_gap"]["cached"] == turns["disk_gap"]["cached"] >= 80
    nogap = turns["prefetch_nogap"]["stats"]  # admitted at once: the lookup waits for the reads it started
    assert nogap["host_tier_prefetch_hits"] > 0
    print(f"\nreturning turn: {sync['disk_tier_hits']} disk hits read at admission "
          f"({sync['disk_tier_seconds_in'] * 1e3:.2f} ms of reads) without the prefetch; with it "
          f"{pre['host_tier_prefetch_hits']} host hits, {pre['host_tier_prefetch_wait_seconds'] * 1e3:.3f} ms "
          f"waited after an 8-step gap, {nogap['host_tier_prefetch_wait_seconds'] * 1e3:.3f} ms with no gap")


def test_files_are_removed_when_the_engine_closes_and_never_made_in_the_repo(tiny64, tmp_path):
    eng = _engine(tiny64, 4, 64)
    disk = eng.block_manager.host_tier.disk
    assert os.path.commonpath([disk.dir, tempfile.gettempdir()]) == tempfile.gettempdir()
    assert os.path.commonpath([disk.dir, REPO]) != REPO
    _returning_turn(eng)
    assert os.path.getsize(disk.path) > 0
    eng.close()
    assert not os.path.exists(disk.dir)
    eng2 = _engine(tiny64, 4, 64, path=str(tmp_path / "kv"))
    d2 = eng2.block_manager.host_tier.disk.dir
    assert os.path.dirname(d2) == str(tmp_path / "kv")
    del eng2
    import gc

    gc.collect()
    assert not os.path.exists(d2), "an engine dropped without close() still removes its disk tier"


def test_config_and_cli():
    import argparse

    from lab_utils.engine.cli import add_engine_args, engine_config_from_args

    with pytest.raises(ValueError, match="the host tier is off"):
        EngineConfig(kv_offload_disk_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"kv_offload_disk_bytes=-1 is invalid"):
        EngineConfig(kv_offload_bytes=1 << 20, kv_offload_disk_bytes=-1)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = engine_config_from_args(parser.parse_args(["--kv-offloading-size", "0.5", "--kv-offloading-disk-size",
                                                     "2", "--kv-offloading-disk-path", "/tmp/x",
                                                     "--kv-offloading-policy", "2q"]))
    assert (cfg.kv_offload_disk_bytes, cfg.kv_offload_disk_path, cfg.kv_offload_policy) == (2 << 30, "/tmp/x", "2q")
    assert engine_config_from_args(parser.parse_args([])).kv_offload_disk_bytes is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_are_pinned_and_asynchronous():
    """On CUDA: the host tier's entries are in pinned memory, blocks come back on the side stream (the compute
    stream waits on their events), and the tokens equal those without the tiers."""
    from lab_utils import load_model

    model = load_model("tiny-random", device="cuda", dtype=torch.float32)
    first, others, message = _conversations()
    results = {}
    for key, host, disk in [("off", None, None), ("tiers", 4, 64)]:
        probe = LLMEngine(model, EngineConfig(block_size=BS, num_gpu_blocks=4), device="cuda")
        per = probe.bytes_per_block
        eng = LLMEngine(model, EngineConfig(block_size=BS, num_gpu_blocks=26, max_num_batched_tokens=256,
                                            kv_offload_bytes=host and host * per,
                                            kv_offload_disk_bytes=disk and disk * per * 2), device="cuda")
        outs = [eng.generate([p], GREEDY)[0] for p in [first, *others]]
        tier = eng.block_manager.host_tier
        if tier is not None:
            assert tier.entries and all(t.is_pinned() for e in tier.entries.values() for t in e.saved.values())
        second = eng.generate([first + outs[0].token_ids + message], GREEDY)[0]
        results[key] = ([o.token_ids for o in outs] + [second.token_ids], second.num_cached_tokens, eng)
    assert results["tiers"][0] == results["off"][0]
    eng = results["tiers"][2]
    assert results["tiers"][1] >= 80 and eng.block_manager.host_tier.block_copies.async_copies_in > 0
    assert eng.stats()["disk_tier_hits"] + eng.stats()["host_tier_prefetch_hits"] > 0
    eng.close()
