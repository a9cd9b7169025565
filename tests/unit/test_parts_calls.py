"""`EngineParts.calls`: the engine counts each call of a learner's part, so "the run used your parts" can fail."""
from __future__ import annotations

import pytest

from lab_utils import EngineConfig, LLMEngine, SamplingParams
from lab_utils.checks.claims import parts_called
from lab_utils.engine.kv.block_manager import BlockManager
from lab_utils.course.parts import EngineParts
from lab_utils.engine.scheduler import Scheduler


def _parts() -> EngineParts:
    def grow(self, req, num_tokens):
        return BlockManager.grow(self, req, num_tokens)

    def preempt(self, req):
        return Scheduler.preempt(self, req)

    return EngineParts({"block_manager.grow": grow, "scheduler.preempt": preempt})


def _run(tiny64, parts: EngineParts, num_blocks: int) -> None:
    eng = LLMEngine(tiny64, EngineConfig(num_gpu_blocks=num_blocks, block_size=4, max_model_len=64), device="cpu",
                    parts=parts)
    eng.generate([[1, 2, 3, 4, 5, 6, 7]] * 6, SamplingParams(max_tokens=20, ignore_eos=True))
    eng.block_manager.check_all_free()


def test_a_run_that_preempts_calls_every_part(tiny64):
    parts = _parts()
    _run(tiny64, parts, num_blocks=16)  # 6 requests of 27 tokens need 42 blocks: the pool runs dry
    assert parts.calls["block_manager.grow"] > 0 and parts.calls["scheduler.preempt"] > 0
    text, ok = parts_called("the run", parts.calls, ["block_manager.grow", "scheduler.preempt"])
    assert ok and "preempt (" in text


def test_a_registered_part_that_never_runs_fails_the_claim(tiny64):
    parts = _parts()
    _run(tiny64, parts, num_blocks=256)  # room for everyone: nobody is preempted
    assert parts.is_learners("scheduler.preempt")  # registered ...
    assert parts.calls["scheduler.preempt"] == 0  # ... but never called
    text, ok = parts_called("the run", parts.calls, ["block_manager.grow", "scheduler.preempt"])
    assert not ok and "never called: scheduler.preempt" in text


def test_counts_are_per_run_when_taken_as_a_difference(tiny64):
    parts = _parts()
    _run(tiny64, parts, num_blocks=16)
    before = parts.calls.copy()
    _run(tiny64, parts, num_blocks=256)
    assert (parts.calls - before)["scheduler.preempt"] == 0 and (parts.calls - before)["block_manager.grow"] > 0


@pytest.mark.parametrize("names", [[], ["block_manager.grow"]])
def test_no_parts_or_no_calls_do_not_pass(names):
    assert not parts_called("the run", {}, names)[1]
