"""Checks for lab 04's exercises: the prefix cache inside the engine's `BlockManager`.

Four parts (see `lab_utils.course.parts`): `hash_block` names a full block, `match_prefix` finds a new prompt's
cached leading blocks, `recycle` decides what happens to a block nobody references any more (kept in the LRU
list if it holds a named prefix, else freed), `evict` takes the least recently used cached block back.

Each `check_*` first runs small hand-built block pools in which one known mistake shows (named by `parts_check`'s
diagnosers when the difference is evidence for it), then `parts_check.check_part` compares the function with the
reference on random engine states in every setting the engine runs it in (prefix caching on and off included:
the engine's "caching off" baselines run these parts too), and, when both pass, makes it the engine's part
(`learner_parts.submit`). The reference is never shown.
"""
from __future__ import annotations

import copy
import random
from typing import Callable

from lab_utils.checks import parts_check
from lab_utils.checks.claims import Claim
from lab_utils.engine.kv.block_manager import BlockManager
from lab_utils.engine.config import EngineConfig
from lab_utils.course.parts import check_signature
from lab_utils.engine.request import Request
from lab_utils.engine.sampling_params import SamplingParams
from lab_utils.engine.scheduler import Scheduler

BS = 4  # block size of the hand-built pools
PROMPT = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34, 41]  # three full blocks and one token


def _req(ids: list[int], rid: str = "new") -> Request:
    return Request(rid, None, list(ids), SamplingParams(max_tokens=4), 0.0)


def _pool(num_blocks: int = 12) -> BlockManager:
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


def _compare(part: str, what: str, fn: Callable, call: Callable, bm: BlockManager) -> None:
    """`call(g, bm) -> (result, block_id or request it was given)` with the reference and with `fn`, on copies
    of `bm`; the first difference fails naming the part, its file, the lab and, where a diagnoser of
    `parts_check` has evidence for it, the likely mistake."""
    cfg = EngineConfig(block_size=BS, enable_prefix_caching=bm.enable_prefix_caching, watermark=0.0)
    sched = Scheduler(cfg, bm)

    def run(g: Callable, s: Scheduler) -> parts_check.Call:
        result, given = call(g, s.bm)
        return parts_check.Call(result=result, called=what, block_id=given if isinstance(given, int) else None,
                                req=given if isinstance(given, Request) else None)

    parts_check.compare_call(f"block_manager.{part}", fn, sched, run, f"the pool with {what}")


def _finish(name: str, fn: Callable, trials: int, seed: int, submit: bool) -> None:
    from lab_utils.course import learner_parts

    parts_check.check_part(name, fn, trials=trials, seed=seed)
    if submit:
        learner_parts.submit(name, fn)


def check_hash_block(fn: Callable, trials: int = 150, seed: int = 0, submit: bool = True) -> None:
    """`fn(self, parent_hash, token_ids) -> int`: the name of a full block, chained over the whole prefix."""
    name = "block_manager.hash_block"
    check_signature(name, fn)
    bm = BlockManager(4, BS)
    rng = random.Random(seed)
    for i in range(20):
        ids = tuple(rng.randrange(49152) for _ in range(BS))
        parent = None if i == 0 else rng.randrange(1 << 40)
        got, want = fn(bm, parent, ids), BlockManager.hash_block(bm, parent, ids)
        if got == want:
            continue
        where = f"(parent_hash={parent}, token_ids={ids})"
        if not isinstance(got, int):
            raise AssertionError(f"{parts_check.where(name)}: returned {type(got).__name__}, not an int {where}")
        if fn(bm, 12345 if parent is None else None, ids) == got:  # another parent, the same name
            raise AssertionError(f"{parts_check.where(name)}: the name does not depend on parent_hash {where}: hash the pair "
                                 f"(parent_hash, token_ids), or two prompts that differ in an earlier block would "
                                 f"share this block, whose K/V were computed for another past")
        raise AssertionError(f"{parts_check.where(name)}: returned {got}, expected {want} {where}: the engine names a block "
                             f"hash((parent_hash, token_ids)), a tuple of the parent's name and the block's ids")
    _finish(name, fn, trials, seed, submit)


def check_match_prefix(fn: Callable, trials: int = 150, seed: int = 0, submit: bool = True) -> None:
    """`fn(self, req) -> [block ids]`: the cached blocks holding the prompt's leading full blocks, in order."""
    name = "block_manager.match_prefix"
    check_signature(name, fn)

    def match(ids: list[int]) -> Callable:
        def call(g, bm):
            req = _req(ids)
            return g(bm, req), req
        return call

    cases = [
        ("the cached 13-token prompt again", PROMPT),
        ("its first 12 tokens: three full blocks, all cached", PROMPT[:12]),
        ("same first block, different second block, same third block", PROMPT[:4] + [9, 9, 9, 9] + PROMPT[8:]),
        ("a prompt sharing nothing", [5, 6, 7, 8, 1, 2, 3, 4, 9]),
    ]
    for what, ids in cases:
        _compare("match_prefix", what, fn, match(ids), _pool())
    # the prompt's second block was evicted, its third is still cached: a hit must be a whole prefix
    bm = _pool()
    second = bm.hash_to_block[BlockManager.hash_block(bm, BlockManager.hash_block(bm, None, tuple(PROMPT[:4])),
                                                      tuple(PROMPT[4:8]))]
    bm.evictable.move_to_end(second, last=False)  # the least recently used: evicted first
    BlockManager.evict(bm)
    _compare("match_prefix", "the cached prompt again after its second block was evicted", fn, match(PROMPT), bm)
    # a hash collision: the name of a new block points at a cached block that holds other tokens
    bm = _pool()
    other = [61, 62, 63, 64, 1]
    bm.hash_to_block[BlockManager.hash_block(bm, None, tuple(other[:4]))] = bm.hash_to_block[
        BlockManager.hash_block(bm, None, tuple(PROMPT[:4]))]
    _compare("match_prefix", "a prompt whose first block's name collides with a cached block of other tokens", fn,
             match(other), bm)
    # caching switched off: the engine's baseline runs must not hit, whatever the pool holds
    bm = _pool()
    bm.enable_prefix_caching = False
    _compare("match_prefix", "the cached prompt again, but enable_prefix_caching off", fn, match(PROMPT), bm)
    _finish(name, fn, trials, seed, submit)


def check_recycle(fn: Callable, trials: int = 150, seed: int = 0, submit: bool = True) -> None:
    """`fn(self, block_id) -> None` for a block whose reference count just reached 0."""
    name = "block_manager.recycle"
    check_signature(name, fn)
    bm = _pool()
    shared = bm.hash_to_block[BlockManager.hash_block(bm, None, tuple(PROMPT[:4]))]  # still used by "second"
    second_own = [b.block_id for b in bm.blocks if b.ref_count == 1 and b.block_id != shared]

    def drop(bid: int) -> Callable:
        def call(g, b):
            b.blocks[bid].ref_count = 0  # its last reference just went
            return g(b, bid), bid
        return call

    named = [b.block_id for b in bm.blocks if b.ref_count == 1 and b.hash is not None and b.block_id != shared]
    unnamed = [b for b in second_own if bm.blocks[b].hash is None]
    _compare("recycle", "the shared first block of the cached prompt, last reference gone", fn, drop(shared), bm)
    if named:
        _compare("recycle", "a named full block of a running request, last reference gone", fn, drop(named[0]), bm)
    _compare("recycle", "the unnamed partial last block of a request", fn, drop(unnamed[0]), bm)
    dup = copy.deepcopy(bm)
    blk = dup.blocks[unnamed[0]]
    blk.hash, blk.token_ids = dup.blocks[shared].hash, dup.blocks[shared].token_ids  # same tokens, computed twice
    _compare("recycle", "a full block whose name belongs to another block (the same tokens, computed twice)", fn,
             drop(unnamed[0]), dup)
    _finish(name, fn, trials, seed, submit)


def check_evict(fn: Callable, trials: int = 150, seed: int = 0, submit: bool = True) -> None:
    """`fn(self) -> block_id`: the least recently used cached block, taken out of the cache."""
    name = "block_manager.evict"
    check_signature(name, fn)
    _compare("evict", "two cached blocks in LRU order, a third still in use", fn, lambda g, b: (g(b), None), _pool())
    _finish(name, fn, trials, seed, submit)


def check_commit_full_blocks(fn: Callable, trials: int = 200, seed: int = 0, submit: bool = True) -> None:
    """`fn(self, req) -> None`: names every block of `req` whose tokens are all computed. Hand-built pools (the
    same prompt computed twice at once; caching off), then random pools in every setting; then the engine names
    blocks with it."""
    name = "block_manager.commit_full_blocks"
    check_signature(name, fn)
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
        _compare("commit_full_blocks", what, fn, call, bm)
    _finish(name, fn, trials, seed, submit)


# --- the lab's closing claims --------------------------------------------------------------------------------
CACHED_RUN_PARTS = tuple(f"block_manager.{p}" for p in ("hash_block", "commit_full_blocks", "match_prefix",
                                                         "recycle", "evict"))


def claims(r: dict) -> list[Claim]:
    """Lab 04's claims from the runs' measurements `r` (built in the notebook's claims cell).

    The TTFT and replay claims expect what this device's prefill costs predict (`ttft_cut_predicted`, from
    `lab_utils.sim.prefill_cost` and the hits of the run): on a CPU a hit saves most of a prompt's prefill; on a GPU a
    small model's prefill is launch-bound, so a hit saves little time there, and the claim says so. `calls`: how
    often the cached runs called each of your parts (`parts.calls` over those runs)."""
    from lab_utils.checks.claims import need, parts_called

    need(r, "hit_rate", "mean_ttft_off_ms", "mean_ttft_on_ms", "ttft_cut_predicted", "replay_s_off", "replay_s_on",
         "hit_rate_by_pool", "replies_identical", "replies", "calls")
    cut, pred = 1 - r["mean_ttft_on_ms"] / r["mean_ttft_off_ms"], r["ttft_cut_predicted"]
    compute_bound = pred >= 0.5  # a hit saves most of the prefill: it must show plainly
    pools = r["hit_rate_by_pool"]
    small, large = pools[min(pools)], pools[max(pools)]
    ratio = r["replay_s_off"] / r["replay_s_on"]
    return [
        (f"hit rate {r['hit_rate']:.2f} >= 0.5 on the shared-prefix workload", r["hit_rate"] >= 0.5),
        (f"TTFT reduced by {100 * cut:.0f}%, >= 0.6x of the {100 * pred:.0f}% this device's measured prefill costs "
         f"predict for these hits" + (" (and >= 30%, as prefill is compute-bound here)" if compute_bound else ""),
         cut >= 0.6 * pred - 0.05 and (cut >= 0.30 or not compute_bound)),
        (f"the replay finishes faster with caching ({ratio:.2f}x)" if pred >= 0.1 else
         f"the replay is no slower with caching ({ratio:.2f}x; prefill is launch-bound here, a hit saves little)",
         r["replay_s_on"] < r["replay_s_off"] if pred >= 0.1 else r["replay_s_on"] <= 1.05 * r["replay_s_off"]),
        (f"memory pressure evicts: hit rate {small:.2f} (smallest pool) < {large:.2f} (largest)", small < large),
        (f"the cache changes no reply: {r['replies_identical']} of {r['replies']} greedy replies identical with "
         f"caching off and on (or parting first at a near-tie of the model's dtype)", r["replies"] > 0 and r["replies_identical"] == r["replies"]),
        parts_called("the cached runs (the replay and the pool sweep, whose small pools evict)", r["calls"],
                     CACHED_RUN_PARTS),
    ]


def assert_claims(r: dict, show: bool = True) -> None:
    """Print lab 04's claims; AssertionError naming each one that fails."""
    from lab_utils.checks.claims import report

    report(claims(r), show)


# every check_* above also records its result in the learner's own log (lab_utils.workshop.records)
from lab_utils.workshop.records import record_checks  # noqa: E402

record_checks(globals())
