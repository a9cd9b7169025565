"""LLMEngine's serving API: what the server's engine loop uses to deliver outputs, set a request aside after a
failed step and let it rejoin, without touching the scheduler's queues."""
from __future__ import annotations

import pytest

from lab_utils import EngineConfig, LLMEngine, SamplingParams
from lab_utils.engine.request import Request, Status

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 40], [8, 9, 10, 11, 12, 13, 14]]


def _engine(tiny64) -> LLMEngine:
    return LLMEngine(tiny64, EngineConfig(max_num_seqs=4, num_gpu_blocks=32, block_size=4,
                                          max_num_batched_tokens=64), device="cpu")


def _run_to_end(eng: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return done


def test_a_request_set_aside_and_resumed_gives_the_same_tokens(tiny64):
    solo = _engine(tiny64).generate(PROMPTS, GREEDY)
    eng = _engine(tiny64)
    a, b = (eng.add_request(p, GREEDY) for p in PROMPTS)
    assert eng.num_waiting == 2 and eng.requests_in_step()[0].request_id == a  # none runs: the queue's head
    for _ in range(3):
        eng.step()
    assert {r.request_id for r in eng.requests_in_step()} == {a, b} and eng.num_waiting == 0

    free = eng.block_manager.num_free_blocks
    req = eng.set_aside(a)
    assert req.status is Status.WAITING and req.num_computed_tokens == 0 and not req.block_table
    assert eng.block_manager.num_free_blocks > free  # its KV went back to the pool
    assert [r.request_id for r in eng.requests_in_step()] == [b] and eng.num_waiting == 0
    eng.step()  # the others go on without it
    assert eng.resume(a) and eng.num_waiting == 1
    with pytest.raises(ValueError, match="already scheduled"):
        eng.resume(a)
    done = _run_to_end(eng)
    assert done == {a: solo[0].token_ids, b: solo[1].token_ids}  # recomputed from its tokens: same greedy output
    eng.block_manager.check_all_free()


def test_a_request_aborted_while_set_aside_does_not_resume(tiny64):
    eng = _engine(tiny64)
    rid = eng.add_request(PROMPTS[0], GREEDY)
    eng.step()
    eng.set_aside(rid)
    assert eng.abort(rid, reason="abort")
    assert not eng.resume(rid)
    eng.block_manager.check_all_free()


def test_pending_outputs_are_copied_or_taken(tiny64):
    eng = _engine(tiny64)
    rid = eng.add_request(PROMPTS[0], GREEDY)
    eng.abort(rid)
    copy = eng.pending_outputs()
    assert [o.request_id for o in copy] == [rid] and copy[0].finished and eng.has_unfinished()
    copy.clear()  # a copy: the engine still holds its own
    taken = eng.take_pending_outputs()
    assert [o.finish_reason for o in taken] == ["abort"]
    assert eng.take_pending_outputs() == [] and not eng.has_unfinished()


def test_admit_queues_a_built_request_or_rejects_it_with_a_reason(tiny64):
    eng = _engine(tiny64)
    ok = Request("ok", None, list(PROMPTS[0]), GREEDY, 0.0)
    assert eng.admit(ok) == "ok" and eng.num_waiting == 1
    too_long = Request("big", None, [7] * 200, SamplingParams(max_tokens=16), 0.0)  # 216 tokens > 32 blocks of 4
    assert eng.admit(too_long) == "big" and eng.num_waiting == 1
    (out,) = eng.take_pending_outputs()
    assert out.request_id == "big" and out.finish_reason.startswith("rejected: ")
    assert eng.num_rejected == 1 and too_long.status is Status.REJECTED
    assert set(_run_to_end(eng)) == {"ok"}
