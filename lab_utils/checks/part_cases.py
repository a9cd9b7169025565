"""Hand-built cases of labs 03 and 04's parts: small states in which one known mistake shows, checked before the
random ones (`parts_check.PartCheck.hand_built`, `precheck`).

A case is `(what, state, call)`: `call(g, state) -> Call` runs the reference or the learner's `g` on a copy of
`state` (a `Scheduler`), and `what` says in a failure which case it was. This module sits below `parts_check`
(it knows nothing of how a difference is reported), so the lab modules and the grader only call down.
"""
from __future__ import annotations

import copy
import random
from typing import Callable

from lab_utils.checks.part_calls import Call
from lab_utils.engine.config import EngineConfig
from lab_utils.engine.kv.block_manager import BlockManager
from lab_utils.engine.request import Request, Status
from lab_utils.engine.sampling_params import SamplingParams
from lab_utils.engine.scheduler import Scheduler

Case = tuple[str, Scheduler, Callable[[Callable, Scheduler], Call]]


# -- lab 03: the token-budget step ---------------------------------------------------------------------------
def _scheduler(budget: int, num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    cfg = EngineConfig(scheduler="token_budget", block_size=4, max_num_batched_tokens=budget,
                       max_num_seqs=max_num_seqs, enable_chunked_prefill=True, enable_prefix_caching=False,
                       watermark=0.0)
    return Scheduler(cfg, BlockManager(num_blocks, 4, enable_prefix_caching=False, watermark=0.0))


def _prompt(rid: str, prompt_len: int) -> Request:
    return Request(rid, None, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=32, ignore_eos=True), 0.0)


def _step(sched: Scheduler) -> None:
    """One reference step and what the engine does after the model ran (count tokens, sample one)."""
    for req, n in sched.schedule().scheduled:
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.token_ids.append(7)


def token_budget_steps() -> list[Case]:
    """The scheduler just before a step, in small steps in which one known mistake shows."""
    out = []
    # two requests decoding, a long prompt arrives: decodes first, then the prompt chunked into what is left
    s = _scheduler(budget=8)
    s.add(_prompt("a", 5)), s.add(_prompt("b", 3))
    _step(s)
    s.add(_prompt("long", 20))
    out.append(("two decodes and a new 20-token prompt, budget 8", s))
    # a prompt half prefilled keeps priority over a new prompt
    s = _scheduler(budget=8)
    s.add(_prompt("a", 20))
    _step(s)
    s.add(_prompt("b", 4))
    out.append(("a 20-token prompt with 8 tokens computed, and a new 4-token prompt, budget 8", s))
    # a finished request must leave before anyone counts the slots
    s = _scheduler(budget=16, max_num_seqs=2)
    s.add(_prompt("a", 3)), s.add(_prompt("b", 3))
    _step(s)
    s.finish(s.running[1], Status.FINISHED)
    s.add(_prompt("c", 4))
    out.append(("max_num_seqs=2, one running request just finished, one new prompt", s))
    # memory short: the step preempts, and then nobody new may join
    s = _scheduler(budget=5, num_blocks=4)
    s.add(_prompt("a", 8)), s.add(_prompt("b", 4))
    for _ in range(3):
        _step(s)
    out.append(("a 4-block pool, two requests; the step must preempt the newest", s))
    return [(f"the step with {what}", sched, lambda f, st, w=what: Call(result=f(st), called=w))
            for what, sched in out]


# -- lab 04: the prefix cache ----------------------------------------------------------------------------------
BS = 4  # block size of the hand-built pools
PROMPT = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34, 41]  # three full blocks and one token


def _req(ids: list[int], rid: str = "new") -> Request:
    return Request(rid, None, list(ids), SamplingParams(max_tokens=4), 0.0)


def cached_pool(num_blocks: int = 12) -> BlockManager:
    """A pool in which PROMPT was computed and finished: its 3 full blocks are cached (named, ref count 0, in
    LRU order), its partial block is free; a second request that shares PROMPT's first block still runs."""
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=True, watermark=0.0)
    first = _req(PROMPT, "first")
    bm.admit(first)
    bm.grow(first, len(PROMPT))
    first.num_computed_tokens = len(PROMPT)
    bm.commit_full_blocks(first)
    second = _req(PROMPT[:4] + [51, 52, 53, 54, 55], "second")
    bm.admit(second)
    bm.grow(second, second.num_prompt_tokens)
    second.num_computed_tokens = second.num_prompt_tokens
    bm.commit_full_blocks(second)
    bm.free(first)
    return bm


def _pool_case(what: str, call: Callable, bm: BlockManager) -> Case:
    """`call(g, bm) -> (result, block_id or request it was given)` as a case on a scheduler over `bm`."""
    cfg = EngineConfig(block_size=BS, enable_prefix_caching=bm.enable_prefix_caching, watermark=0.0)

    def run(g: Callable, s: Scheduler) -> Call:
        result, given = call(g, s.bm)
        return Call(result=result, called=what, block_id=given if isinstance(given, int) else None,
                    req=given if isinstance(given, Request) else None)

    return f"the pool with {what}", Scheduler(cfg, bm), run


def hash_block_precheck(fn: Callable, where: str, seed: int = 0) -> None:
    """`fn(self, parent_hash, token_ids) -> int` against the engine's on 20 random blocks: the message says whether
    the name is not an int, ignores its parent, or is another hash."""
    bm = BlockManager(4, BS)
    rng = random.Random(seed)
    for i in range(20):
        ids = tuple(rng.randrange(49152) for _ in range(BS))
        parent = None if i == 0 else rng.randrange(1 << 40)
        got, want = fn(bm, parent, ids), BlockManager.hash_block(bm, parent, ids)
        if got == want:
            continue
        at = f"(parent_hash={parent}, token_ids={ids})"
        if not isinstance(got, int):
            raise AssertionError(f"{where}: returned {type(got).__name__}, not an int {at}")
        if fn(bm, 12345 if parent is None else None, ids) == got:  # another parent, the same name
            raise AssertionError(f"{where}: the name does not depend on parent_hash {at}: hash the pair "
                                 f"(parent_hash, token_ids), or two prompts that differ in an earlier block would "
                                 f"share this block, whose K/V were computed for another past")
        raise AssertionError(f"{where}: returned {got}, expected {want} {at}: the engine names a block "
                             f"hash((parent_hash, token_ids)), a tuple of the parent's name and the block's ids")


def match_prefix_cases() -> list[Case]:
    def match(ids: list[int]) -> Callable:
        def call(g, bm):
            req = _req(ids)
            return g(bm, req), req
        return call

    out = [_pool_case(what, match(ids), cached_pool()) for what, ids in [
        ("the cached 13-token prompt again", PROMPT),
        ("its first 12 tokens: three full blocks, all cached", PROMPT[:12]),
        ("same first block, different second block, same third block", PROMPT[:4] + [9, 9, 9, 9] + PROMPT[8:]),
        ("a prompt sharing nothing", [5, 6, 7, 8, 1, 2, 3, 4, 9]),
    ]]
    # the prompt's second block was evicted, its third is still cached: a hit must be a whole prefix
    bm = cached_pool()
    second = bm.hash_to_block[BlockManager.hash_block(bm, BlockManager.hash_block(bm, None, tuple(PROMPT[:4])),
                                                      tuple(PROMPT[4:8]))]
    bm.evictable.move_to_end(second, last=False)  # the least recently used: evicted first
    BlockManager.evict(bm)
    out.append(_pool_case("the cached prompt again after its second block was evicted", match(PROMPT), bm))
    # a hash collision: the name of a new block points at a cached block that holds other tokens
    bm = cached_pool()
    other = [61, 62, 63, 64, 1]
    bm.hash_to_block[BlockManager.hash_block(bm, None, tuple(other[:4]))] = bm.hash_to_block[
        BlockManager.hash_block(bm, None, tuple(PROMPT[:4]))]
    out.append(_pool_case("a prompt whose first block's name collides with a cached block of other tokens",
                          match(other), bm))
    # caching switched off: the engine's baseline runs must not hit, whatever the pool holds
    bm = cached_pool()
    bm.enable_prefix_caching = False
    out.append(_pool_case("the cached prompt again, but enable_prefix_caching off", match(PROMPT), bm))
    return out


def recycle_cases() -> list[Case]:
    bm = cached_pool()
    shared = bm.hash_to_block[BlockManager.hash_block(bm, None, tuple(PROMPT[:4]))]  # still used by "second"
    second_own = [b.block_id for b in bm.blocks if b.ref_count == 1 and b.block_id != shared]

    def drop(bid: int) -> Callable:
        def call(g, b):
            b.blocks[bid].ref_count = 0  # its last reference just went
            return g(b, bid), bid
        return call

    named = [b.block_id for b in bm.blocks if b.ref_count == 1 and b.hash is not None and b.block_id != shared]
    unnamed = [b for b in second_own if bm.blocks[b].hash is None]
    out = [_pool_case("the shared first block of the cached prompt, last reference gone", drop(shared), bm)]
    if named:
        out.append(_pool_case("a named full block of a running request, last reference gone", drop(named[0]), bm))
    out.append(_pool_case("the unnamed partial last block of a request", drop(unnamed[0]), bm))
    dup = copy.deepcopy(bm)
    blk = dup.blocks[unnamed[0]]
    blk.hash, blk.token_ids = dup.blocks[shared].hash, dup.blocks[shared].token_ids  # same tokens, computed twice
    out.append(_pool_case("a full block whose name belongs to another block (the same tokens, computed twice)",
                          drop(unnamed[0]), dup))
    return out


def evict_cases() -> list[Case]:
    return [_pool_case("two cached blocks in LRU order, a third still in use", lambda g, b: (g(b), None),
                       cached_pool())]


def commit_full_blocks_cases() -> list[Case]:
    out = []
    for caching in (True, False):
        bm = BlockManager(12, BS, enable_prefix_caching=caching, watermark=0.0)
        twins = [_req(PROMPT, "first"), _req(PROMPT, "twin")]
        for r in twins:  # admitted in the same step: neither found the other's blocks in the cache
            bm.admit(r)
            bm.grow(r, len(PROMPT))
            r.num_computed_tokens = len(PROMPT)
        bm.commit_full_blocks(twins[0])

        def call(g, b, twin=twins[1]):  # the request lives outside the pool: each run gets its own copy
            req = copy.deepcopy(twin)
            return g(b, req), req

        what = ("the same 13-token prompt computed twice in one step, the first copy already named" if caching else
                "a computed 13-token prompt, enable_prefix_caching off")
        out.append(_pool_case(what, call, bm))
    return out
