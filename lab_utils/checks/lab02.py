"""Checks for lab 02's exercises: the block allocator (`grow`, `release`), preemption (`make_room`, `preempt`) and
the slot mapping, each compared with the engine's own part and then saved as the learner's; the block-table gather
(`gather_kv`); and the lab's claims. `check_append_slots` checks a one-function allocator on plain lists (grow a
block table, return the new tokens' slots) with the usual mistakes named; no lab's exercise uses it.

Each check runs the learner's function on fresh random cases, compares with a reference, and raises
AssertionError saying what differs (and, for known mistakes, what the mistake looks like). It never shows the
reference code. A `NotImplementedError` from the learner's function propagates unchanged.
"""
from __future__ import annotations

from collections.abc import Mapping

import copy
import random
from typing import Callable

import torch

from lab_utils.checks.lab00 import compare


# --- exercise 1: the block allocator -------------------------------------------------------------------------


def _reference_append_slots(block_table, num_tokens, num_new, free_blocks, block_size):
    need = -(-(num_tokens + num_new) // block_size) - len(block_table)
    if need > len(free_blocks):
        raise MemoryError("out of blocks")
    for _ in range(max(need, 0)):
        block_table.append(free_blocks.pop())
    return [block_table[t // block_size] * block_size + t % block_size for t in range(num_tokens, num_tokens + num_new)]


def _case(rng: random.Random, num_blocks: int = 24) -> dict:
    bs = rng.choice([1, 2, 4, 8, 16])
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    num_tokens = rng.randint(0, 5 * bs)
    table = [pool.pop() for _ in range(-(-num_tokens // bs))]
    return dict(block_table=table, num_tokens=num_tokens, num_new=rng.randint(1, 3 * bs), free_blocks=pool,
                block_size=bs)


def check_append_slots(fn: Callable, seed: int | None = None, cases: int = 40) -> None:
    """`fn(block_table, num_tokens, num_new, free_blocks, block_size) -> slots`: grows `block_table` in place with
    blocks popped from the end of `free_blocks`, returns the slot of each new token; raises MemoryError (changing
    nothing) when the free list is too short."""
    rng = random.Random(seed if seed is not None else random.randrange(1 << 30))
    for i in range(cases):
        c = _case(rng)
        mine, ref = copy.deepcopy(c), copy.deepcopy(c)
        want = _reference_append_slots(ref["block_table"], ref["num_tokens"], ref["num_new"], ref["free_blocks"],
                                       ref["block_size"])
        got = fn(mine["block_table"], mine["num_tokens"], mine["num_new"], mine["free_blocks"], mine["block_size"])
        where = (f"(case {i}: block_size={c['block_size']}, num_tokens={c['num_tokens']}, num_new={c['num_new']}, "
                 f"block_table={c['block_table']})")
        if got is None:
            raise AssertionError(f"append_slots returned None; it must return the list of new slots {where}")
        got = [int(s) for s in got]
        n_new = len(mine["block_table"]) - len(c["block_table"])
        n_want = len(ref["block_table"]) - len(c["block_table"])
        if mine["block_table"][:len(c["block_table"])] != c["block_table"]:
            raise AssertionError(f"the blocks the sequence already had were changed: {c['block_table']} -> "
                                 f"{mine['block_table'][:len(c['block_table'])]} {where}")
        if n_new != n_want:
            hint = ""
            if n_new > n_want:
                hint = " (allocating more than needed: is there room left in the last block? ceil, not floor + 1)"
            elif n_new < n_want:
                hint = " (too few: a new token needs a block whenever its position crosses a block boundary)"
            raise AssertionError(f"block_table grew by {n_new} blocks but {n_want} were needed{hint} {where}")
        if mine["block_table"] != ref["block_table"]:
            raise AssertionError(f"block_table is {mine['block_table']} but expected {ref['block_table']}: take new "
                                 f"blocks with free_blocks.pop() (the end of the list) {where}")
        if mine["free_blocks"] != ref["free_blocks"]:
            raise AssertionError(f"free_blocks should have lost exactly the blocks you appended {where}")
        if len(got) != len(want):
            raise AssertionError(f"returned {len(got)} slots for {c['num_new']} new tokens {where}")
        if got != want:
            k = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
            diag = ""
            if got[k] == c["num_tokens"] + k:
                diag = " (that is the token's position, not its slot: look its block up in the block table)"
            elif got[k] == mine["block_table"][(c["num_tokens"] + k) // c["block_size"]]:
                diag = " (that is a block id: slot = block_id * block_size + offset)"
            raise AssertionError(f"slot of new token {k} (position {c['num_tokens'] + k}) is {got[k]}, expected "
                                 f"{want[k]}{diag} {where}")
    # out of memory: raise MemoryError and change nothing
    c = dict(block_table=[3], num_tokens=4, num_new=9, free_blocks=[7], block_size=4)
    mine = copy.deepcopy(c)
    try:
        fn(mine["block_table"], mine["num_tokens"], mine["num_new"], mine["free_blocks"], mine["block_size"])
    except MemoryError:
        pass
    else:
        raise AssertionError("13 tokens need 4 blocks of 4; the sequence has 1 and only 1 is free: expected "
                             "MemoryError")
    if mine != c:
        raise AssertionError(f"after MemoryError nothing may change, but the state became {mine} (was {c}): check "
                             f"that enough blocks are free before taking any")
    print(f"check_append_slots passed ({cases} random cases + out-of-blocks)")


# --- exercise 2: the block-table gather ----------------------------------------------------------------------


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
    from lab_utils.engine.block_manager import BlockManager
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
                                args=f"make_room(request '0', num_tokens=20) with running {[r.request_id for r in s.running]}")

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


def claims(contiguous: dict, paged: dict, same: int, num_requests: int, calls: Mapping[str, int],
           all_finished: bool) -> dict[str, bool]:
    """Lab 02's claims from the two runs' measurements (`table_rows[...]`), each with its verdict. `calls`: how
    often the paged run called each of your parts (`parts.calls` over the run)."""
    from lab_utils.checks.claims import parts_called

    c, p = contiguous, paged
    used, ran = parts_called("the paged run (its pool ran dry, so it preempted)", calls, PAGED_RUN_PARTS)
    return {
        f"paged waste {100 * p['kv_waste']:.2f}% < 4% of allocated KV memory": p["kv_waste"] < 0.04,
        f"contiguous reservation waste {100 * c['kv_waste']:.0f}% > 50%": c["kv_waste"] > 0.5,
        f">= 2x more sequences resident at once ({p['peak_running']} vs {c['peak_running']})":
            p["peak_running"] >= 2 * c["peak_running"],
        f"greedy outputs identical in both layouts, or parting first at a near-tie ({same}/{num_requests})":
            same == num_requests,
        used: ran,
        "every request finished with all its tokens in both layouts": all_finished,
    }


def assert_claims(verdicts: dict[str, bool]) -> None:
    for claim, ok in verdicts.items():
        print(("PASS  " if ok else "FAIL  ") + claim)
    failed = [cl for cl, ok in verdicts.items() if not ok]
    assert not failed, f"claims that do not hold: {failed}"


# every check_* above also records its result in the learner's own log (lab_utils.workshop.records)
from lab_utils.workshop.records import record_checks  # noqa: E402

record_checks(globals())
