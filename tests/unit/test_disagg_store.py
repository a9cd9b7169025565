"""The prefill -> decode hand-off through the shared KV store (`DisaggregatedCluster(kv_transfer="store")`): the
decode worker gets the prompt's full blocks from the store by name and the partial last block on the pipe, and
continues exactly as with the whole KV on the pipe; a block the store dropped makes it recompute, never lose, the
request; a second cluster on the same store reads a shared prefix instead of computing it.

The model is lab 10's test model (a small untied random Llama in float64, `lab_utils.parallel.toy_model`), so
greedy outputs depend on the whole context and differently batched steps cannot flip an argmax.
"""
from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from lab_utils import EngineConfig, LLMEngine, SamplingParams
from lab_utils.disagg import DisaggregatedCluster, admit_prefilled, colocated_run, export_prompt_kv, pack, unpack
from lab_utils.disagg.store_handoff import admit_to_recompute, fetch_prompt_kv, publish_prompt_kv
from lab_utils.kvstore.store import KVStoreProcess
from lab_utils.parallel.toy_model import TOY_CONFIG, write_toy_model

CFG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_gpu_blocks=128)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], [100, 200, 301, 7, 7], list(range(1000, 1030))]
FULL_BLOCKS = [1, 0, 1, 7]  # blocks of 4 tokens in each prompt; the rest is its partial last block
BLOCK_BYTES = 2 * TOY_CONFIG["num_hidden_layers"] * TOY_CONFIG["num_key_value_heads"] * 16 * 8 * 4  # K and V, fp64


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return str(write_toy_model(tmp_path_factory.mktemp("toy")))


def _ids(outs):
    return [o.token_ids for o in outs]


def _hand_off(pre, dec, store, params):
    """Prefill every prompt on `pre`; each hand-off through `store` into `dec`. Returns {request: recomputed?}."""
    for i, p in enumerate(PROMPTS):
        pre.add_request(p, params, request_id=str(i))
    put, got, recomputed = store.client(), store.client(), {}
    while pre.has_unfinished():
        for out in pre.step():
            req = pre.requests[out.request_id]
            if out.finished:
                continue
            whole = export_prompt_kv(pre, req)
            meta = dict(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, params=params,
                        arrival_time=req.metrics.arrival_time, first_token=req.token_ids[-1],
                        first_token_time=req.metrics.first_token_time,
                        first_scheduled_time=req.metrics.first_scheduled_time)
            pre.abort(req.request_id)
            names, tail, sent = publish_prompt_kv(put, whole, req.prompt_token_ids, 4)
            meta, tail = unpack(pack(meta, tail))
            kv, rec = fetch_prompt_kv(got, names, meta["prompt_token_ids"], 4, tail)
            assert rec["store_get_bytes"] == rec["store_blocks_got"] * BLOCK_BYTES
            assert sent["store_put_bytes"] == sent["store_blocks_put"] * BLOCK_BYTES
            if kv is None:
                admit_to_recompute(dec, meta)
            else:
                assert all(torch.equal(kv[n], whole[n]) for n in whole)  # byte for byte the prefill side's KV
                admit_prefilled(dec, meta, kv)
            recomputed[req.request_id] = kv is None
    done = {}
    while dec.has_unfinished():
        done.update({o.request_id: o for o in dec.step() if o.finished})
    pre.block_manager.check_all_free()
    dec.block_manager.check_all_free()
    return [done[str(i)] for i in range(len(PROMPTS))], recomputed


def test_hand_off_through_the_store_in_one_process(toy):
    """The mechanism without worker processes: blocks to the store and back, the tail beside them; a store too
    small for a prompt's blocks drops its first ones before they are read, and that request is recomputed."""
    from lab_utils.models.loader import load_model

    model_tok = load_model(toy, device="cpu", dtype=torch.float64)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = _ids(LLMEngine(model_tok, CFG, device="cpu").generate(PROMPTS, params))
    with KVStoreProcess(capacity_bytes=64 << 20) as store:
        outs, recomputed = _hand_off(LLMEngine(model_tok, CFG, device="cpu"), LLMEngine(model_tok, CFG, device="cpu"),
                                     store, params)
        st = store.client().store_stats()
    assert _ids(outs) == ref and not any(recomputed.values())
    assert st.blocks == st.puts == sum(FULL_BLOCKS) and st.put_bytes == st.get_bytes == sum(FULL_BLOCKS) * BLOCK_BYTES
    assert all(o.metrics.token_times[0] == o.metrics.first_token_time for o in outs)
    with KVStoreProcess(capacity_bytes=2 * BLOCK_BYTES) as tiny:  # two blocks: the 30-token prompt has seven
        outs, recomputed = _hand_off(LLMEngine(model_tok, CFG, device="cpu"), LLMEngine(model_tok, CFG, device="cpu"),
                                     tiny, params)
        st = tiny.client().store_stats()
    assert recomputed["3"] and st.dropped >= 5
    assert _ids(outs) == ref  # recomputed, not lost: the same tokens


def test_a_store_that_refuses_a_block_leaves_it_on_the_pipe():
    kv = {"k": torch.arange(2 * 10 * 3, dtype=torch.float64).reshape(2, 10, 3)}
    with KVStoreProcess(capacity_bytes=10) as store:  # smaller than one block
        names, tail, rec = publish_prompt_kv(store.client(), kv, list(range(10)), 4)
        assert names == [] and torch.equal(tail["k"], kv["k"]) and rec["store_blocks_put"] == 0
    names, tail, rec = publish_prompt_kv(store.client(), kv, list(range(10)), 4)  # the store has gone
    assert names == [] and "store_put_error" in rec and torch.equal(tail["k"], kv["k"])
    got, rec = fetch_prompt_kv(store.client(), [b"x"], list(range(10)), 4, tail)
    assert got is None and "store_get_error" in rec  # the decode side recomputes
    with KVStoreProcess(capacity_bytes=1 << 20) as store:  # a block of another model's shape under the name
        names, _, _ = publish_prompt_kv(store.client(), {"k": torch.zeros(3, 10, 3)}, list(range(10)), 4)
        got, rec = fetch_prompt_kv(store.client(), names, list(range(10)), 4, {"k": kv["k"][:, 8:]})
        assert got is None and "store_get_error" in rec


def test_bad_arguments():
    with pytest.raises(ValueError, match="kv_transfer"):
        DisaggregatedCluster("tiny-random", kv_transfer="rdma")
    with pytest.raises(ValueError, match="kv_store"):
        DisaggregatedCluster("tiny-random", kv_store=object())


def _no_leaks(cluster) -> dict:
    report = cluster.worker_stats()
    for who, w in report.items():
        assert w["referenced_blocks"] == 0 and w["unfinished_requests"] == 0, (who, w)
        assert w["num_free_blocks"] == w["num_blocks"], (who, w)
    return report


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cluster_through_the_store_equals_the_pipe_and_a_second_cluster_reads_the_shared_prefix(toy):
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (8, 1, 8, 5)]
    with DisaggregatedCluster(toy, CFG, dtype="float64", startup_timeout_s=240) as piped:
        want = piped.generate(PROMPTS, params, timeout_s=240)
        pipe = piped.transfer_stats()
    with KVStoreProcess(capacity_bytes=64 << 20) as store:
        with DisaggregatedCluster(toy, CFG, dtype="float64", startup_timeout_s=240, audit_kv=True,
                                  kv_transfer="store", kv_store=store) as cluster:
            outs = cluster.generate(PROMPTS, params, timeout_s=240)
            assert _no_leaks(cluster)["prefill"]["reads_store"]  # its prefix cache looks in the store too
            stats = cluster.transfer_stats()
            audit = cluster.kv_handoff_check()
        assert _ids(outs) == _ids(want) and [o.text for o in outs] == [o.text for o in want]
        assert audit == {"requests": 3, "blocks": 2 + 2 + 8, "mismatched": []}  # the same KV, block by block
        blocks = FULL_BLOCKS[0] + FULL_BLOCKS[2] + FULL_BLOCKS[3]  # the max_tokens=1 request is not handed off
        assert stats["num_transfers"] == pipe["num_transfers"] == 3 and stats["num_recomputed"] == 0
        assert stats["store_blocks_put"] == stats["store_blocks_got"] == blocks
        assert stats["store_put_bytes_total"] == stats["store_get_bytes_total"] == blocks * BLOCK_BYTES
        # what left the pipe went through the store instead: the KV bytes add up to the pipe path's
        assert stats["bytes_total"] + stats["store_get_bytes_total"] - pipe["bytes_total"] < 3 * 2000
        assert stats["store_put_s_mean"] > 0 and stats["store_get_s_mean"] > 0
        # a second cluster on the same store: its prefill worker reads the 30-token prompt's 7 blocks from the
        # store and computes only the rest; its prefill side finds them there and puts only the new block
        longer = PROMPTS[3] + [7, 8, 9, 10]
        with DisaggregatedCluster(toy, CFG, dtype="float64", startup_timeout_s=240, kv_transfer="store",
                                  kv_store=store) as second:
            again = second.generate([longer], SamplingParams(max_tokens=6, ignore_eos=True), timeout_s=240)[0]
            _no_leaks(second)
            s2 = second.transfer_stats()
        assert again.num_cached_tokens == 28
        assert s2["store_blocks_held"] == 7 and s2["store_blocks_put"] == 1 and s2["store_blocks_got"] == 8
        ref = colocated_run(toy, CFG, [longer], SamplingParams(max_tokens=6, ignore_eos=True), dtype="float64")
        assert again.token_ids == ref[0].token_ids
        assert store.process.is_alive()  # a store passed in is its owner's to stop
        # and a prefill worker of lab 14's pool on the same store: all 8 blocks of that prompt are there
        from lab_utils.kvstore.workers import PrefillWorkers

        with PrefillWorkers(toy, CFG, n=1, store=store, dtype="float64", startup_timeout_s=240) as pool:
            third = pool.prefill(0, longer + [11])
        assert third["num_cached_tokens"] == 32 and third["blocks_from_store"] == 8 and not third["leaked"]
        assert store.process.is_alive()
    assert multiprocessing.active_children() == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_block_dropped_from_a_tiny_store_is_recomputed_not_lost(toy):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ref = colocated_run(toy, CFG, PROMPTS, params, dtype="float64")
    with DisaggregatedCluster(toy, CFG, dtype="float64", startup_timeout_s=240, kv_transfer="store",
                              kv_store_bytes=2 * BLOCK_BYTES) as cluster:
        outs = cluster.generate(PROMPTS, params, timeout_s=240)
        _no_leaks(cluster)
        stats = cluster.transfer_stats()
        rec = cluster._records[outs[3].request_id]
        st = cluster.store_stats()
        address = cluster.kv_store.address
    assert _ids(outs) == _ids(ref) and all(o.finish_reason == "length" for o in outs)
    assert rec["recomputed"] and rec["store_blocks_missing"] == 7 and rec["store_blocks_got"] == 0
    assert stats["num_recomputed"] >= 1 and st.dropped >= 5
    assert stats["store_get_bytes_total"] == stats["store_blocks_got"] * BLOCK_BYTES
    assert multiprocessing.active_children() == []  # the workers and the cluster's own store
    assert not os.path.exists(address)


SWAPPED_IMPORT = """
import torch


def import_kv(cache, block_table, kv, block_size):
    n = kv["k"].shape[1]
    table = list(block_table)
    if n == 8:  # the prompt's two full blocks, each written where the other belongs
        table[:2] = table[1::-1]
    slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(n)])
    for name, t in kv.items():
        cache[name][:, slots] = t
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_learners_import_kv_runs_on_the_store_path_and_the_audit_sees_it(toy, tmp_path, monkeypatch):
    """The blocks from the store go into the decode worker's cache through the learner's disagg.import_kv, as on
    the pipe path: one that swaps two blocks gives the same tokens and is caught block by block."""
    from lab_utils.course import learner_parts

    folder = tmp_path / "my_engine"
    folder.mkdir()
    (folder / "disagg.py").write_text(SWAPPED_IMPORT)
    monkeypatch.setenv("LAB_LEARNER_DIR", str(folder))
    learner_parts.forget()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = [list(range(5, 13))] + PROMPTS[1:]
    ref = colocated_run(toy, CFG, prompts, params, dtype="float64")
    with DisaggregatedCluster(toy, CFG, dtype="float64", startup_timeout_s=240, audit_kv=True, kv_transfer="store",
                              learner_parts=["disagg.import_kv"]) as cluster:
        outs = cluster.generate(prompts, params, timeout_s=240)
        audit = cluster.kv_handoff_check()
        stats = cluster.transfer_stats()
    assert cluster.learner_parts_ran["decode"] == ["disagg.import_kv"]
    assert stats["store_blocks_got"] == 2 + 0 + 1 + 7 and stats["num_recomputed"] == 0
    assert _ids(outs) == _ids(ref)  # two full blocks swapped: the same tokens, the wrong KV
    assert sorted(block for _, block in audit["mismatched"]) == [0, 1]
    assert {rid.split("-")[1] for rid, _ in audit["mismatched"]} == {"0"}
