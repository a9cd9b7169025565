"""One call of an engine part on a random engine state: its arguments, drawn from the state, and what it did.

Each argument generator takes the scheduler (a copy: the reference and the learner's part each get their own) and
a `random.Random`, and returns the `Call` to make: the arguments, a line that says what was called on what, and
the request or block it was given, so a failure can show them. It returns None when the state holds nothing to
call the part on (no running request to preempt, no cached block to evict). Given equal copies and equally
seeded generators it draws the same arguments for both, so the two calls can be compared value by value.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from lab_utils.engine.request import Request, Status
from lab_utils.engine.sampling_params import SamplingParams
from lab_utils.engine.scheduler import Scheduler, SchedulerOutput


@dataclass
class Call:
    """One call of a part: its arguments (`args`), what was called on what (`called`, shown in a failure), the
    result, the request or block it was given, and the step's output it filled."""
    args: tuple = ()
    called: str = ""
    result: object = None
    out: SchedulerOutput | None = None
    req_id: str | None = None
    block_id: int | None = None
    req: Request | None = None
    skipped: bool = False


def result_view(o) -> object:
    """A result in the terms compared and shown: a step's scheduled (request, tokens) and preempted ids, a
    request's id, anything else as it is."""
    if isinstance(o, SchedulerOutput):
        return {"scheduled": [(r.request_id, n) for r, n in o.scheduled],
                "preempted": [r.request_id for r in o.preempted]}
    if isinstance(o, Request):
        return o.request_id
    return o


def describe_req(r: Request) -> str:
    return (f"request {r.request_id!r} ({r.num_prompt_tokens} prompt + {r.num_output_tokens} output tokens, "
            f"{r.num_computed_tokens} computed, block table {r.block_table}, {r.status.value})")


def _live(sched: Scheduler) -> list[Request]:
    return [r for r in sched.running if r.status is Status.RUNNING]


def step_args(sched: Scheduler, rng: random.Random) -> Call:
    """`schedule_continuous()` / `schedule_token_budget()`: one scheduling step of the state as it is."""
    return Call(called=f"one step; running {[r.request_id for r in sched.running]}, waiting "
                       f"{[r.request_id for r in sched.waiting]}")


def make_room_args(sched: Scheduler, rng: random.Random) -> Call | None:
    """`make_room(req, num_tokens, out)`: a running request that needs up to 6 blocks more."""
    live = _live(sched)
    if not live:
        return None
    req = live[rng.randrange(len(live))]
    n = req.num_computed_tokens + rng.randint(1, 6 * sched.bm.block_size)
    out = SchedulerOutput()
    return Call(args=(req, n, out), out=out, req_id=req.request_id, req=req,
                called=f"make_room({describe_req(req)}, num_tokens={n}); running {[r.request_id for r in live]}")


def preempt_args(sched: Scheduler, rng: random.Random) -> Call | None:
    """`preempt(req)`: a running request."""
    live = _live(sched)
    if not live:
        return None
    req = live[rng.randrange(len(live))]
    return Call(args=(req,), req=req, req_id=req.request_id, called=f"preempt({describe_req(req)})")


def grow_args(sched: Scheduler, rng: random.Random) -> Call:
    """`grow(req, num_tokens)`: mostly a running request, else a new one with no blocks yet."""
    live = _live(sched)
    if live and rng.random() < 0.7:
        req = live[rng.randrange(len(live))]
    else:
        req = Request("new", None, [1] * 8, SamplingParams(), 0.0)
    n = req.num_computed_tokens + rng.randint(0, 4 * sched.bm.block_size)
    return Call(args=(req, n), req=req, req_id=req.request_id,
                called=f"grow({describe_req(req)}, num_tokens={n}); {sched.bm.num_free_blocks} blocks free or cached")


def release_args(sched: Scheduler, rng: random.Random) -> Call | None:
    """`release(block_id)`: a block in use, half the time one that several requests share."""
    used = [b.block_id for b in sched.bm.blocks if b.ref_count > 0]
    shared = [b for b in used if sched.bm.blocks[b].ref_count > 1]  # the case reference counts exist for
    pick = shared if shared and rng.random() < 0.5 else used
    if not pick:
        return None
    bid = pick[rng.randrange(len(pick))]
    blk = sched.bm.blocks[bid]
    return Call(args=(bid,), block_id=bid,
                called=f"release({bid}); block {bid} has ref_count {blk.ref_count}, " + (
                    "a name (it holds a cached prefix)" if blk.hash is not None else "no name"))


def recycle_args(sched: Scheduler, rng: random.Random) -> Call | None:
    """`recycle(block_id)`: a block whose last reference just went (dropped here, before the call)."""
    used = [b for b in sched.bm.blocks if b.ref_count == 1]
    if not used:
        return None
    blk = used[rng.randrange(len(used))]
    blk.ref_count = 0
    return Call(args=(blk.block_id,), block_id=blk.block_id,
                called=f"recycle({blk.block_id}); block {blk.block_id} has " + (
                    f"the name {blk.hash}" if blk.hash is not None else "no name"))


def evict_args(sched: Scheduler, rng: random.Random) -> Call | None:
    """`evict()`: when some block is cached."""
    if not sched.bm.evictable:
        return None
    return Call(called=f"evict(); cached blocks, least recently used first: {list(sched.bm.evictable)}")


def match_prefix_args(sched: Scheduler, rng: random.Random) -> Call:
    """`match_prefix(req)`: a waiting request, or a new 20-token one when nobody waits."""
    waiting = list(sched.waiting) or [Request("q", None, [rng.randrange(100) for _ in range(20)],
                                              SamplingParams(), 0.0)]
    req = waiting[rng.randrange(len(waiting))]
    return Call(args=(req,), req=req, req_id=req.request_id, called=f"match_prefix({describe_req(req)})")


def commit_full_blocks_args(sched: Scheduler, rng: random.Random) -> Call | None:
    """`commit_full_blocks(req)`: a running request, half the time right after one more token was computed."""
    live = _live(sched)
    if not live:
        return None
    req = live[rng.randrange(len(live))]
    if req.num_computed_tokens < req.num_tokens and rng.random() < 0.5:
        req.num_computed_tokens += 1  # a token just computed: its block may have become full
    return Call(args=(req,), req=req, req_id=req.request_id, called=f"commit_full_blocks({describe_req(req)})")


def hash_block_args(sched: Scheduler, rng: random.Random) -> Call:
    """`hash_block(parent_hash, token_ids)`: a full block's ids, with or without a parent."""
    parent = rng.choice([None, rng.randrange(1 << 30)])
    ids = tuple(rng.randrange(100) for _ in range(sched.bm.block_size))
    return Call(args=(parent, ids), called=f"hash_block({parent}, {ids})")
