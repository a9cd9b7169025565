"""The engine's invariants between a replaced part (a learner's, in the labs) and the rest of the engine: each
refuses a broken result with a message that names the rule it broke, before the model runner fails three calls
later. They run only when the engine's `parts` replace something (`guarded` classes, a replaced slot mapping).

- `check_retired`, `check_step`: what a scheduling policy returns, checked on every step (`Scheduler.schedule`);
- `checked_slots`: a learner's slot mapping (lab 02), compared with the engine's before any K/V is written.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from lab_utils.engine.replaceable import LearnerPartError
from lab_utils.engine.request import Status

if TYPE_CHECKING:
    from lab_utils.engine.scheduler import Scheduler, SchedulerOutput


def policy_name(policy: Callable) -> str:
    """A policy's name in messages: a replaced part carries its own (`__part_label__`, set by whoever replaced
    it: the course names a learner's step with its lab and the file it is saved in)."""
    return getattr(policy, "__part_label__", None) or policy.__name__


def check_retired(scheduler: Scheduler, who: str) -> None:
    """A step starts by retiring the requests that ended: none may be left in `running`."""
    stale = [r.request_id for r in scheduler.running if r.status.done]
    if stale:
        raise LearnerPartError(f"{who}: requests {stale} had ended but are still in self.running: "
                               f"retire finished requests (status.done) at the start of the step")


def check_step(scheduler: Scheduler, out: SchedulerOutput, policy: str) -> None:
    """Everything the model runner relies on, checked on every step (cheap: one pass over the batch)."""
    cfg, seen = scheduler.config, set()

    def fail(msg: str) -> None:
        raise LearnerPartError(f"{policy}: {msg}")

    if len(scheduler.running) > cfg.max_num_seqs:
        fail(f"{len(scheduler.running)} requests are running but max_num_seqs is {cfg.max_num_seqs}: admit only "
             f"while len(self.running) < max_num_seqs")
    if out.num_tokens > cfg.max_num_batched_tokens:
        fail(f"the step has {out.num_tokens} tokens but the budget (max_num_batched_tokens) is "
             f"{cfg.max_num_batched_tokens}")
    for req, n in out.scheduled:
        if id(req) in seen:
            fail(f"{req.request_id} is scheduled twice in one step")
        seen.add(id(req))
        if req.status.done:
            fail(f"{req.request_id} has already {req.status.value} but was scheduled: retire finished "
                 f"requests (status.done) from self.running before scheduling")
        if req.status is not Status.RUNNING or req not in scheduler.running:
            if any(r is req for r in out.preempted):
                fail(f"{req.request_id} was preempted in this step (it is in out.preempted) and then scheduled: "
                     f"making room for an older request may preempt one later in self.running, so skip a request "
                     f"whose status is no longer Status.RUNNING")
            fail(f"{req.request_id} is scheduled but is {req.status.value}, not in self.running: admit "
                 f"with self.start(req, n), which moves it from the queue into the batch")
        remaining = req.num_tokens - req.num_computed_tokens
        if not 1 <= n <= remaining:
            fail(f"{req.request_id} is scheduled for {n} tokens but has {remaining} left to compute "
                 f"(a decode is 1; a prompt chunk is at most what is left)")
        if len(req.block_table) * scheduler.bm.block_size < req.num_computed_tokens + n:
            fail(f"{req.request_id} is scheduled for {n} tokens but its blocks hold only "
                 f"{len(req.block_table) * scheduler.bm.block_size} of the {req.num_computed_tokens + n} needed: "
                 f"grow its block table first (self.make_room / self.bm.grow)")
    order = [r for r in scheduler.waiting]
    if any(r.status is Status.RUNNING for r in order):
        fail("a request in the waiting queue is marked RUNNING")


def checked_slots(slots, expected: torch.Tensor, block_tables, context_lens, query_lens) -> torch.Tensor:
    """A learner's slot mapping, refused (with the first wrong slot) before any K/V is written to a wrong place."""
    got = torch.as_tensor(list(slots), dtype=torch.long)
    if got.shape != expected.shape:
        raise LearnerPartError(f"your attention.slot_mapping returned {got.numel()} slots for a step that computes "
                               f"{expected.numel()} tokens (query_lens={list(query_lens)})")
    bad = (got != expected).nonzero()
    if len(bad):
        n = int(bad[0])
        seq = next(i for i, c in enumerate(torch.tensor(query_lens).cumsum(0).tolist()) if n < c)
        pos = context_lens[seq] - query_lens[seq] + n - sum(query_lens[:seq])
        raise LearnerPartError(
            f"your attention.slot_mapping put token {n} of the step (sequence {seq}, position {pos}, block table "
            f"{block_tables[seq][:8]}{'...' if len(block_tables[seq]) > 8 else ''}) in slot {int(got[n])}; it "
            f"belongs in slot {int(expected[n])}: that sequence's K/V would overwrite another token's")
    return got
