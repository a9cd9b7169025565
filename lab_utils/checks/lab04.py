"""Checks for lab 04's exercises: the prefix cache inside the engine's `BlockManager`.

Four parts (see `lab_utils.engine.parts`): `hash_block` names a full block, `match_prefix` finds a new prompt's
cached leading blocks, `recycle` decides what happens to a block nobody references any more (kept in the LRU
list if it holds a named prefix, else freed), `evict` takes the least recently used cached block back.

Each `check_*` first runs small hand-built block pools in which one known mistake shows and is named, then
`parts_check.check_part` compares the function with the reference on random engine states (every piece of state
it touches), and, when both pass, makes it the engine's part (`learner.submit`). The reference is never shown.
"""
from __future__ import annotations

import copy
import random
from typing import Callable

from lab_utils.checks import parts_check
from lab_utils.engine.block_manager import BlockManager
from lab_utils.engine.parts import check_signature
from lab_utils.engine.request import Request
from lab_utils.engine.sampling_params import SamplingParams

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


def _state(bm: BlockManager) -> dict:
    return {"free_ids": sorted(bm.free_ids), "evictable (LRU order)": list(bm.evictable),
            "hash_to_block": dict(bm.hash_to_block), "ref_counts": [b.ref_count for b in bm.blocks],
            "block names (hash, token_ids)": [(b.hash, b.token_ids) for b in bm.blocks]}


def _compare(part: str, what: str, fn: Callable, call: Callable, bm: BlockManager, mistake: str,
             state_mistake: str | None = None) -> None:
    """Run `call(reference)` and `call(fn)` on copies of `bm`; the first difference fails naming `mistake`
    (`state_mistake` when it returned the right value but left the pool in another state)."""
    a, b = copy.deepcopy(bm), copy.deepcopy(bm)
    want = call(getattr(BlockManager, part), a)
    try:
        got = call(fn, b)
    except NotImplementedError:
        raise
    except Exception as err:
        raise AssertionError(f"block_manager.{part} ({what}): your function raised {type(err).__name__}: {err}") \
            from err
    if got != want:
        raise AssertionError(f"block_manager.{part} ({what}): it returned {got!r}; expected {want!r}\n"
                             f"likely mistake: {mistake}")
    sa, sb = _state(a), _state(b)
    key = next((k for k in sa if sa[k] != sb[k]), None)
    if key is not None:
        raise AssertionError(f"block_manager.{part} ({what}): afterwards {key} is {sb[key]!r}; expected "
                             f"{sa[key]!r}\nlikely mistake: {state_mistake or mistake}")


def _finish(name: str, fn: Callable, trials: int, seed: int, submit: bool) -> None:
    from lab_utils import learner

    parts_check.check_part(name, fn, trials=trials, seed=seed)
    if submit:
        learner.submit(name, fn)


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
            raise AssertionError(f"{name}: returned {type(got).__name__}, not an int {where}")
        if got == hash(ids) or (parent is not None and got == BlockManager.hash_block(bm, None, ids)):
            raise AssertionError(f"{name}: the name does not depend on parent_hash {where}: hash the pair "
                                 f"(parent_hash, token_ids), or two prompts that differ in an earlier block would "
                                 f"share this block, whose K/V were computed for another past")
        raise AssertionError(f"{name}: returned {got}, expected {want} {where}: the engine names a block "
                             f"hash((parent_hash, token_ids)), a tuple of the parent's name and the block's ids")
    _finish(name, fn, trials, seed, submit)


def check_match_prefix(fn: Callable, trials: int = 150, seed: int = 0, submit: bool = True) -> None:
    """`fn(self, req) -> [block ids]`: the cached blocks holding the prompt's leading full blocks, in order."""
    name = "block_manager.match_prefix"
    check_signature(name, fn)

    cases = [
        ("the cached 13-token prompt again", _req(PROMPT),
         "walk the prompt's full blocks in order: parent = self.hash_block(parent, ids), look the name up in "
         "self.hash_to_block, and keep the block id while it hits"),
        ("its first 12 tokens: three full blocks, all cached", _req(PROMPT[:12]),
         "you matched every full block of the prompt: leave at least one prompt token to compute (match at most "
         "(num_prompt_tokens - 1) // block_size blocks), because the step that computes the last prompt token "
         "produces the logits the first output token is sampled from"),
        ("same first block, different second block, same third block", _req(PROMPT[:4] + [9, 9, 9, 9] + PROMPT[8:]),
         "stop at the first block that misses: a later block with equal tokens was computed after another past, "
         "and its chained name differs anyway (chain the names, parent = the previous block's name)"),
        ("a prompt sharing nothing", _req([5, 6, 7, 8, 1, 2, 3, 4, 9]),
         "a prompt whose first block misses matches nothing: return []"),
    ]
    for what, req, mistake in cases:
        _compare("match_prefix", what, fn, lambda g, bm, r=req: g(bm, _req(r.prompt_token_ids)), _pool(), mistake)
    # a hash collision: the name of a new block points at a cached block that holds other tokens
    bm = _pool()
    other = [61, 62, 63, 64, 1]
    bm.hash_to_block[BlockManager.hash_block(bm, None, tuple(other[:4]))] = bm.hash_to_block[
        BlockManager.hash_block(bm, None, tuple(PROMPT[:4]))]
    _compare("match_prefix", "a prompt whose first block's name collides with a cached block of other tokens", fn,
             lambda g, b: g(b, _req(other)), bm,
             "equal names almost always mean equal tokens, but not always: compare the cached block's token_ids "
             "(self.blocks[bid].token_ids) with the prompt's, and treat a difference as a miss")
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
            return g(b, bid)
        return call

    named = [b.block_id for b in bm.blocks if b.ref_count == 1 and b.hash is not None and b.block_id != shared]
    unnamed = [b for b in second_own if bm.blocks[b].hash is None]
    _compare("recycle", "the shared first block of the cached prompt, last reference gone", fn, drop(shared), bm,
             "a block that holds a named prefix (self.hash_to_block[block.hash] == block_id) stays cached: put it "
             "at the end (the most recently used) of self.evictable (self.evictable[block_id] = None), not back "
             "in free_ids, so a later prompt can still hit it")
    if named:
        _compare("recycle", "a named full block of a running request, last reference gone", fn, drop(named[0]), bm,
                 "a block with a name goes to the end of the LRU list self.evictable (the newest), not the front")
    _compare("recycle", "the unnamed partial last block of a request", fn, drop(unnamed[0]), bm,
             "a block without a name (block.hash is None) can never be hit: free it (self.free_ids.append)")
    dup = copy.deepcopy(bm)
    blk = dup.blocks[unnamed[0]]
    blk.hash, blk.token_ids = dup.blocks[shared].hash, dup.blocks[shared].token_ids  # same tokens, computed twice
    _compare("recycle", "a full block whose name belongs to another block (the same tokens, computed twice)", fn,
             drop(unnamed[0]), dup,
             "a block is cached only if the name leads to it (self.hash_to_block.get(block.hash) == block_id); a "
             "duplicate no lookup can find is freed, and forgets its name (block.hash = None, block.token_ids = ())")
    _finish(name, fn, trials, seed, submit)


def check_evict(fn: Callable, trials: int = 150, seed: int = 0, submit: bool = True) -> None:
    """`fn(self) -> block_id`: the least recently used cached block, taken out of the cache."""
    name = "block_manager.evict"
    check_signature(name, fn)
    _compare("evict", "two cached blocks in LRU order, a third still in use", fn, lambda g, b: g(b), _pool(),
             "you evicted another block than the least recently used one: take the front of self.evictable "
             "(self.evictable.popitem(last=False)); the end holds the most recently used",
             "the evicted block must forget its name: drop it from self.hash_to_block and clear block.hash and "
             "block.token_ids, or a later prompt would hit a block that now holds other tokens")
    _finish(name, fn, trials, seed, submit)


# --- the lab's closing claims --------------------------------------------------------------------------------
def prefill_cost_fit(prompt_lens: list[int], ttfts_s: list[float]) -> tuple[float, float]:
    """(a, b) of TTFT = a + b x prompt tokens, least squares over prefills timed alone (TTFT is then the prefill)
    at lengths far apart. a is what a step costs whatever its size (kernel launches, scheduling), b what a prompt
    token costs on this device: a CPU is mostly b; a small model on a GPU is mostly a (launch-bound)."""
    n = len(prompt_lens)
    if n < 2 or len(ttfts_s) != n:
        raise ValueError(f"need a TTFT for each of >= 2 prompts, got {n} prompts and {len(ttfts_s)} TTFTs")
    mx, my = sum(prompt_lens) / n, sum(ttfts_s) / n
    sxx = sum((x - mx) ** 2 for x in prompt_lens)
    b = sum((x - mx) * (y - my) for x, y in zip(prompt_lens, ttfts_s)) / sxx if sxx else 0.0
    a = my - b * mx
    if a < 0:  # attention makes long prefills super-linear: a line through the origin instead
        a, b = 0.0, sum(x * y for x, y in zip(prompt_lens, ttfts_s)) / sum(x * x for x in prompt_lens)
    elif b < 0:  # timing noise on a flat, launch-bound cost: no per-token cost
        a, b = my, 0.0
    return a, b


def predicted_ttft_cut(fit: tuple[float, float], prompt_lens: list[int], cached: list[int]) -> float:
    """The share of mean TTFT prefix caching should save, from the fitted costs: a hit skips its tokens' b, never
    the step's a (at least one token is always computed)."""
    a, b = fit
    off = sum(a + b * n for n in prompt_lens)
    on = sum(a + b * max(1, n - c) for n, c in zip(prompt_lens, cached))
    return 1 - on / off if off > 0 else 0.0


def claims(r: dict) -> list[tuple[str, bool]]:
    """Lab 04's claims from the runs' measurements `r` (built in the notebook's claims cell).

    The TTFT and replay claims expect what this device's prefill costs predict (`ttft_cut_predicted`, from
    `prefill_cost_fit` and the hits of the run): on a CPU a hit saves most of a prompt's prefill; on a GPU a
    small model's prefill is launch-bound, so a hit saves little time there, and the claim says so."""
    from lab_utils.checks.claims import need

    need(r, "hit_rate", "mean_ttft_off_ms", "mean_ttft_on_ms", "ttft_cut_predicted", "replay_s_off", "replay_s_on",
         "hit_rate_by_pool", "replies_identical", "replies", "learners_parts")
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
         f"caching off and on", r["replies"] > 0 and r["replies_identical"] == r["replies"]),
        ("the cached runs used your hash_block, match_prefix, recycle and evict (the engine's parts are yours)",
         bool(r["learners_parts"])),
    ]


def assert_claims(r: dict, show: bool = True) -> None:
    """Print lab 04's claims; AssertionError naming each one that fails."""
    from lab_utils.checks.claims import report

    report(claims(r), show)


def check_commit_full_blocks(fn) -> None:
    """Your `commit_full_blocks` against the engine's on random pools; then the engine names blocks with it."""
    from lab_utils import learner
    from lab_utils.checks.parts_check import check_part

    check_part("block_manager.commit_full_blocks", fn, trials=200)
    learner.submit("block_manager.commit_full_blocks", fn)
