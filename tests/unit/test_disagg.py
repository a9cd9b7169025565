"""Prefill/decode disaggregation: the KV handed from a prefill engine to a decode engine gives the colocated
engine's greedy outputs, in one process and across real worker processes; a killed decode worker loses nothing.

The model is a small untied random Llama in float64 (see `lab_utils.parallel.toy_model`), so greedy outputs
depend on the whole context and differently batched steps cannot flip an argmax.
"""
from __future__ import annotations

import multiprocessing

import pytest
import torch

from lab_utils import EngineConfig, LLMEngine, SamplingParams
from lab_utils.disagg import (
    DisaggregatedCluster,
    admit_prefilled,
    colocated_run,
    export_prompt_kv,
    pack,
    unpack,
)
from lab_utils.parallel.toy_model import TOY_CONFIG, write_toy_model

CFG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_gpu_blocks=128)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], [100, 200, 301, 7, 7], list(range(1000, 1030))]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return str(write_toy_model(tmp_path_factory.mktemp("toy")))


def _ids(outs):
    return [o.token_ids for o in outs]


def test_pack_unpack_round_trip():
    kv = {"k": torch.randn(2, 5, 3, 4, dtype=torch.bfloat16), "v": torch.arange(24, dtype=torch.int8).view(2, 3, 4),
          "empty": torch.zeros(0, 4)}
    meta, back = unpack(pack({"request_id": "r1", "first_token": 7}, kv))
    assert meta == {"request_id": "r1", "first_token": 7}
    for name, t in kv.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t)


def test_prefilled_kv_admitted_as_a_swapped_request_in_one_process(toy):
    """The mechanism without processes: prefill in engine P, export the prompt KV, admit into engine D."""
    from lab_utils.models.loader import load_model

    model_tok = load_model(toy, device="cpu", dtype=torch.float64)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = _ids(LLMEngine(model_tok, CFG, device="cpu").generate(PROMPTS, params))
    pre, dec = LLMEngine(model_tok, CFG, device="cpu"), LLMEngine(model_tok, CFG, device="cpu")
    for i, p in enumerate(PROMPTS):
        pre.add_request(p, params, request_id=str(i))
    handed = 0
    while pre.has_unfinished():
        for out in pre.step():
            req = pre.requests[out.request_id]
            if out.finished:
                continue
            kv = export_prompt_kv(pre, req)
            assert kv["k"].shape == (3, len(req.prompt_token_ids), 3, 16)
            meta = dict(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, params=params,
                        arrival_time=req.metrics.arrival_time, first_token=req.token_ids[-1],
                        first_token_time=req.metrics.first_token_time,
                        first_scheduled_time=req.metrics.first_scheduled_time)
            pre.abort(req.request_id)
            admit_prefilled(dec, *unpack(pack(meta, kv)))
            handed += 1
    pre.block_manager.check_all_free()
    done = {}
    while dec.has_unfinished():
        done.update({o.request_id: o for o in dec.step() if o.finished})
    assert handed == len(PROMPTS)
    assert [done[str(i)].token_ids for i in range(len(PROMPTS))] == ref
    assert all(done[str(i)].metrics.token_times[0] == done[str(i)].metrics.first_token_time for i in range(4))
    dec.block_manager.check_all_free()


@pytest.mark.timeout(600)
def test_cluster_equals_colocated_and_requeues_after_a_killed_decode_worker(toy):
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (8, 1, 8, 5)]
    arrivals = [0.0, 0.0, 0.05, 0.1]
    ref = colocated_run(toy, CFG, PROMPTS, params, arrival_times=arrivals, dtype="float64")
    long = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (2, 150, 150, 150)]
    ref_long = colocated_run(toy, CFG, PROMPTS, long, dtype="float64")
    with DisaggregatedCluster(toy, CFG, dtype="float64", startup_timeout_s=240, audit_kv=True) as cluster:
        workers = cluster.processes
        outs = cluster.generate(PROMPTS, params, arrival_times=arrivals, timeout_s=240)
        assert _ids(outs) == _ids(ref) and [o.text for o in outs] == [o.text for o in ref]
        audit = cluster.kv_handoff_check()  # every handed-off block arrived where the prefill worker had it
        assert audit == {"requests": 3, "blocks": 2 + 2 + 8, "mismatched": []}
        assert [len(o.metrics.token_times) for o in outs] == [8, 1, 8, 5]
        assert all(o.metrics.ttft > 0 and o.finish_reason == "length" for o in outs)
        stats = cluster.transfer_stats()
        # the max_tokens=1 request ends at the prefill worker: no transfer
        assert stats["num_transfers"] == 3
        kv_bytes_per_token = 2 * TOY_CONFIG["num_hidden_layers"] * TOY_CONFIG["num_key_value_heads"] * 16 * 8
        tokens = sum(len(PROMPTS[i]) for i in (0, 2, 3))
        assert kv_bytes_per_token * tokens < stats["bytes_total"] < kv_bytes_per_token * tokens + 3 * 2000
        assert stats["seconds_per_transfer_mean"] > 0

        # fault: kill the decode worker as soon as the short request is back; the long ones are in flight there
        killed = []

        def kill_once(out):
            if not killed:
                killed.append(out.request_id)
                cluster.kill_decode_worker()

        outs = cluster.generate(PROMPTS, long, on_output=kill_once, timeout_s=400)
        assert killed and len(cluster.failures) == 1
        failure = cluster.failures[0]
        assert failure.worker == "decode" and failure.exitcode == -9 and failure.requests
        assert cluster.num_requeued == len(failure.requests)
        assert _ids(outs) == _ids(ref_long)  # re-queued requests were re-prefilled, nothing lost or changed
        assert not any(p.is_alive() for p in workers.values())  # the old workers are gone
    assert multiprocessing.active_children() == []


# A learner's import_kv with one mistake per prompt length (prompts of 8, 3, 5 and 30 tokens, blocks of 4): the
# 8-token prompt's two full blocks swapped, the 5-token prompt's tokens one slot off, the 30-token prompt's last block
# never written (it keeps what the pool held: a stale block), the 3-token prompt right.
WRONG_IMPORT = """
import torch


def import_kv(cache, block_table, kv, block_size):
    n = kv["k"].shape[1]
    table = list(block_table)
    if n == 8:  # the prompt's two blocks (the table has a third, for the first decoded token)
        table[:2] = table[1::-1]
    slots = [table[t // block_size] * block_size + (t + (n == 5)) % block_size for t in range(n)]
    if n == 30:
        slots = slots[:(len(table) - 1) * block_size]
    for name, t in kv.items():
        cache[name][:, torch.tensor(slots)] = t[:, :len(slots)]
"""


@pytest.mark.timeout(400)
def test_the_kv_audit_catches_a_wrong_block_order_a_wrong_slot_and_a_stale_block(toy, tmp_path, monkeypatch):
    """Greedy tokens cannot show a hand-off that reorders whole blocks (with RoPE inside K, attention does not
    depend on the order of the (K, V) pairs), so the two-process path compares the KV itself, block by block."""
    from lab_utils.course import learner_parts

    folder = tmp_path / "my_engine"
    folder.mkdir()
    (folder / "disagg.py").write_text(WRONG_IMPORT)
    monkeypatch.setenv("LAB_LEARNER_DIR", str(folder))
    learner_parts.forget()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = [list(range(5, 13))] + PROMPTS[1:]
    ref = colocated_run(toy, CFG, prompts, params, dtype="float64")
    with DisaggregatedCluster(toy, CFG, dtype="float64", startup_timeout_s=240, audit_kv=True,
                              learner_parts=["disagg.import_kv"]) as cluster:
        outs = cluster.generate(prompts, params, timeout_s=240)
        audit = cluster.kv_handoff_check()
    assert cluster.learner_parts_ran["decode"] == ["disagg.import_kv"]
    assert outs[0].token_ids == ref[0].token_ids  # two full blocks swapped: the same tokens, the wrong KV
    bad = {rid.split("-")[1]: [] for rid, _ in audit["mismatched"]}
    for rid, block in audit["mismatched"]:
        bad[rid.split("-")[1]].append(block)
    assert bad == {"0": [0, 1], "2": [0, 1], "3": [7]}, audit


@pytest.mark.timeout(400)
def test_fail_policy_reports_every_in_flight_request(toy):
    long = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (2, 150, 150, 150)]
    with DisaggregatedCluster(toy, CFG, dtype="float64", on_worker_failure="fail", startup_timeout_s=240) as cluster:
        outs = cluster.generate(PROMPTS, long, on_output=lambda o: cluster.kill_decode_worker(), timeout_s=240)
    assert len(outs) == len(PROMPTS) and all(o.finished for o in outs)
    assert len(outs[0].token_ids) == 2
    failed = [o for o in outs if o.finish_reason.startswith("error: decode worker died")]
    assert failed and all(o.token_ids == [] for o in failed)
    assert {o.request_id for o in failed} == set(cluster.failures[0].requests)
    assert multiprocessing.active_children() == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="on_worker_failure"):
        DisaggregatedCluster("tiny-random", on_worker_failure="ignore")
    with pytest.raises(ValueError, match="dtype"):
        DisaggregatedCluster("tiny-random", dtype="int3")


def test_colocated_run_can_reuse_one_engine(tiny64):
    """Labs pass their own engine: two runs on it must not collide on request ids, and every block comes back."""
    engine = LLMEngine(tiny64, EngineConfig(num_gpu_blocks=64), device="cpu")
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    first = colocated_run(engine, None, [[1, 2, 3], [4, 5]], params, arrival_times=[0.0, 0.05])
    second = colocated_run(engine, None, [[1, 2, 3], [4, 5]], params)
    assert _ids(first) == _ids(second) and all(len(t) == 3 for t in _ids(first))
    assert first[1].metrics.arrival_time - first[0].metrics.arrival_time == pytest.approx(0.05, abs=1e-6)
    engine.block_manager.check_all_free()
