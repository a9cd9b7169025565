"""Checks for lab 02's exercises: the block allocator (`grow`, `release`), preemption (`make_room`, `preempt`) and
the slot mapping, each compared with the engine's own part and then saved as the learner's; the block-table gather
(`gather_kv`); and the lab's claims.

Each check runs the learner's function on fresh random cases, compares with a reference, and raises
AssertionError saying what differs (and, for known mistakes, what the mistake looks like). It never shows the
reference code. A `NotImplementedError` from the learner's function propagates unchanged.
"""
from __future__ import annotations

import random
from typing import Callable

import torch

from lab_utils.checks.claims import Claim
from lab_utils.checks.lab00 import compare


# --- the block-table gather ----------------------------------------------------------------------------------


def _reference_gather(cache, block_table, context_len, block_size):
    slots = [block_table[t // block_size] * block_size + t % block_size for t in range(context_len)]
    return cache[torch.tensor(slots, dtype=torch.long)]


def check_gather_kv(fn: Callable, seed: int | None = None, cases: int = 20) -> None:
    """`fn(cache [num_slots, H, D], block_table, context_len, block_size) -> [context_len, H, D]`."""
    rng = random.Random(seed if seed is not None else random.randrange(1 << 30))
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for i in range(cases):
        bs = rng.choice([1, 2, 4, 8, 16])
        num_blocks = rng.randint(4, 16)
        ctx = rng.randint(1, num_blocks * bs)
        if i == 0:
            ctx = bs * 2 + 1 if num_blocks * bs > bs * 2 + 1 else ctx  # always one partly filled last block
        ids = list(range(num_blocks))
        rng.shuffle(ids)
        table = ids[:-(-ctx // bs)]
        H, D = rng.choice([1, 2, 3]), rng.choice([4, 8])
        cache = torch.randn(num_blocks * bs, H, D, generator=g)
        want = _reference_gather(cache, table, ctx, bs)
        got = fn(cache, list(table), ctx, bs)
        where = f"(case {i}: block_size={bs}, context_len={ctx}, block_table={table})"
        if isinstance(got, torch.Tensor) and got.dim() == 3 and got.shape[0] != ctx:
            if got.shape[0] == len(table) * bs:
                raise AssertionError(f"got {got.shape[0]} tokens = all slots of the sequence's blocks; keep only the "
                                     f"first context_len={ctx} (the last block is partly empty) {where}")
        if isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype \
                and not torch.allclose(got, want):
            if torch.equal(got, cache[:ctx]):
                raise AssertionError(f"you read slots 0..{ctx - 1} of the pool directly: a sequence's tokens live in "
                                     f"the blocks its block_table names, in that order {where}")
            in_order = _reference_gather(cache, sorted(table), ctx, bs)
            if torch.equal(got, in_order):
                raise AssertionError(f"the blocks came back sorted by id; logical block i is block_table[i] {where}")
        compare(f"gather_kv {where}", got, want, dims="token,head,dim")
    print(f"check_gather_kv passed ({cases} random cases)")


# -- the engine parts (lab 02's exercises) -----------------------------------------------------------------
def check_allocator(grow: Callable, release: Callable, cases: int = 200) -> None:
    """Your `grow` and `release` against the engine's on random block pools; then they become the engine's."""
    from lab_utils.course import learner_parts
    from lab_utils.checks.parts_check import check_part

    check_part("block_manager.grow", grow, trials=cases)
    check_part("block_manager.release", release, trials=cases)
    learner_parts.submit("block_manager.grow", grow)
    learner_parts.submit("block_manager.release", release)


def _full_pool(preemption_mode: str = "recompute"):
    """Three requests decoding in a full 6-block pool (block size 4): the oldest holds 2 blocks, the two newer 2
    each; the oldest now needs 3 more blocks, so one victim is not enough."""
    from lab_utils.engine.kv.block_manager import BlockManager
    from lab_utils.engine.config import EngineConfig
    from lab_utils.engine.request import Request, Status
    from lab_utils.engine.sampling_params import SamplingParams
    from lab_utils.engine.scheduler import Scheduler

    cfg = EngineConfig(block_size=4, watermark=0.0, enable_prefix_caching=False, preemption_mode=preemption_mode)
    sched = Scheduler(cfg, BlockManager(6, 4, enable_prefix_caching=False, watermark=0.0))
    for i in range(3):
        req = Request(str(i), None, list(range(1, 8)), SamplingParams(max_tokens=20, ignore_eos=True), 0.0)
        sched.add(req)
        sched.start(req, 7)
        req.num_computed_tokens = 7
        req.token_ids.append(9)
        req.status = Status.RUNNING
    return sched


def check_preemption(make_room: Callable, preempt: Callable, cases: int = 200) -> None:
    """Your `make_room` and `preempt` against the engine's: a full pool where one victim is not enough, then
    random scheduler states (pools short of blocks) in every setting the engine runs them in."""
    from lab_utils.course import learner_parts
    from lab_utils.checks import parts_check
    from lab_utils.checks.parts_check import check_part
    from lab_utils.engine.scheduler import SchedulerOutput

    check_part("scheduler.preempt", preempt, trials=cases)

    def grow_oldest(g, s):
        out, req = SchedulerOutput(), s.running[0]
        return parts_check.Call(result=g(s, req, 20, out), out=out, req=req, req_id=req.request_id,
                                called=f"make_room(request '0', num_tokens=20) with running {[r.request_id for r in s.running]}")

    parts_check.compare_call("scheduler.make_room", make_room, _full_pool(), grow_oldest,
                             "a full pool where the oldest of three requests needs 3 more blocks")
    check_part("scheduler.make_room", make_room, trials=cases)
    learner_parts.submit("scheduler.preempt", preempt)
    learner_parts.submit("scheduler.make_room", make_room)


def check_slot_mapping(fn: Callable, cases: int = 200) -> None:
    """Your `slot_mapping` against the engine's on random block tables and steps; then the engine uses it."""
    from lab_utils.course import learner_parts
    from lab_utils.checks.parts_check import check_part

    check_part("attention.slot_mapping", fn, trials=cases)
    learner_parts.submit("attention.slot_mapping", fn)


# -- the lab's claims ----------------------------------------------------------------------------------------
PAGED_RUN_PARTS = ("block_manager.grow", "block_manager.release", "scheduler.make_room", "scheduler.preempt",
                   "attention.slot_mapping")


def claims(r: dict) -> list[Claim]:
    """Lab 02's claims from the two runs' measurements `r` (built in the notebook's claims cell).

    `contiguous`, `paged`: each layout's row of the results table (`kv_waste`, `peak_running`); `same`: requests
    whose greedy outputs agree in both layouts (or part first at a near-tie), of `num_requests`; `calls`: how often
    the paged run called each of your parts (`parts.calls` over the run); `all_finished`: every request of both
    runs finished with all its tokens."""
    from lab_utils.checks.claims import need, parts_called

    need(r, "contiguous", "paged", "same", "num_requests", "calls", "all_finished")
    c, p, same, n = r["contiguous"], r["paged"], r["same"], r["num_requests"]
    return [
        (f"paged waste {100 * p['kv_waste']:.2f}% < 4% of allocated KV memory", p["kv_waste"] < 0.04),
        (f"contiguous reservation waste {100 * c['kv_waste']:.0f}% > 50%", c["kv_waste"] > 0.5),
        (f">= 2x more sequences resident at once ({p['peak_running']} vs {c['peak_running']})",
         p["peak_running"] >= 2 * c["peak_running"]),
        (f"greedy outputs identical in both layouts, or parting first at a near-tie ({same}/{n})", same == n),
        parts_called("the paged run (its pool ran dry, so it preempted)", r["calls"], PAGED_RUN_PARTS),
        ("every request finished with all its tokens in both layouts", bool(r["all_finished"])),
    ]


def assert_claims(r: dict, show: bool = True) -> None:
    """Print lab 02's claims; AssertionError naming each one that fails."""
    from lab_utils.checks.claims import report

    report(claims(r), show)


# every check_* above also records its result in the learner's own log (lab_utils.workshop.records)
from lab_utils.workshop.records import record_checks  # noqa: E402

record_checks(globals())
