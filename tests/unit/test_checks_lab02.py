"""Lab 02's checkers accept correct solutions and reject each common mistake with a useful message."""
from __future__ import annotations

import pytest
import torch

from lab_utils.checks import lab02


def good_gather(cache, block_table, context_len, block_size):
    slots = torch.tensor([b * block_size + o for b in block_table for o in range(block_size)][:context_len])
    return cache[slots]


def test_gather_checker_accepts_correct(capsys):
    lab02.check_gather_kv(good_gather, seed=0)
    lab02.check_gather_kv(good_gather)
    assert "check_gather_kv passed" in capsys.readouterr().out


@pytest.mark.parametrize("bad, message", [
    (lambda c, bt, n, bs: c[torch.tensor([b * bs + o for b in bt for o in range(bs)])], "first context_len"),
    (lambda c, bt, n, bs: c[:n], "directly"),
    (lambda c, bt, n, bs: good_gather(c, sorted(bt), n, bs), "sorted"),
    (lambda c, bt, n, bs: good_gather(c, bt, n, bs).double(), "dtype"),
    (lambda c, bt, n, bs: good_gather(c, bt, n, bs) + 1e-2, "first wrong index"),
])
def test_gather_checker_rejects_mistakes(bad, message):
    with pytest.raises(AssertionError, match=message):
        lab02.check_gather_kv(bad, seed=1)


def test_not_implemented_propagates():
    def todo(*a):
        raise NotImplementedError("hint")

    with pytest.raises(NotImplementedError):
        lab02.check_gather_kv(todo, seed=0)


# -- the engine parts: allocator, preemption, slot mapping --------------------------------------------------------
def _grow_no_check(self, req, num_tokens):
    for _ in range(self.blocks_needed(num_tokens) - len(req.block_table)):
        req.block_table.append(self.take_block())  # raises when the pool is empty, after changing the table
    return True


def _release_always(self, block_id):
    self.blocks[block_id].ref_count = 0
    self.recycle(block_id)


def _preempt_keeps_progress(self, req):
    from lab_utils.engine.request import Status

    self.running.remove(req)
    self.num_preemptions += 1
    req.metrics.preemptions += 1
    self.bm.free(req)
    req.status = Status.WAITING
    self.waiting.append(req)  # to the back, and num_computed_tokens not reset


def _slots_from_zero(block_tables, context_lens, query_lens, block_size):
    return [t[p // block_size] * block_size + p % block_size
            for t, c, q in zip(block_tables, context_lens, query_lens) for p in range(q)]


@pytest.fixture
def learner_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_LEARNER_DIR", str(tmp_path))
    return tmp_path


def test_check_allocator_rejects_wrong_parts(learner_dir):
    from lab_utils.engine.kv.block_manager import BlockManager

    with pytest.raises(AssertionError, match="block_manager.grow"):
        lab02.check_allocator(_grow_no_check, BlockManager.release)
    with pytest.raises(AssertionError, match="last reference"):
        lab02.check_allocator(BlockManager.grow, _release_always)
    lab02.check_allocator(BlockManager.grow, BlockManager.release, cases=40)
    assert "def grow(" in (learner_dir / "block_manager.py").read_text()


def test_check_preemption_rejects_wrong_parts(learner_dir):
    from lab_utils.engine.scheduler import Scheduler

    with pytest.raises(AssertionError, match="scheduler.preempt"):
        lab02.check_preemption(Scheduler.make_room, _preempt_keeps_progress)


def test_check_slot_mapping_rejects_wrong_slots(learner_dir):
    from lab_utils.engine.attention import slot_mapping

    with pytest.raises(AssertionError, match="last query_len positions"):
        lab02.check_slot_mapping(_slots_from_zero)
    lab02.check_slot_mapping(slot_mapping, cases=40)
