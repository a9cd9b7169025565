"""The engine states a part check runs on, and what it compares after a call.

`random_state` builds a scheduler mid-run (a block pool driven by the reference for a random number of steps, no
model needed) in one of the settings the engine runs a part in (`settings`: prefix caching off and on, preemption
by recompute and by swap, a prefill-first step with whole prompts and a token-budget step with chunked prefill).
`snapshot` is everything a part may change, named as the learner calls it; `first_difference` finds the first
entry two snapshots disagree on, one level deep, so a failure shows one value and not a state dump.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from lab_utils.course.parts import PARTS
from lab_utils.engine.kv.block_manager import BlockManager
from lab_utils.engine.config import EngineConfig
from lab_utils.engine.request import Request, Status
from lab_utils.engine.sampling_params import SamplingParams
from lab_utils.engine.scheduler import Scheduler, SchedulerOutput


# -- the settings a part runs in ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    policy: str  # "continuous" (prefill-first, whole prompts) or "token_budget" (chunked prefill)
    caching: bool
    preemption: str  # "recompute" or "swap"

    @property
    def chunked(self) -> bool:
        return self.policy == "token_budget"

    def __str__(self) -> str:
        step = "token-budget step, chunked prefill" if self.chunked else "prefill-first step, whole prompts"
        return f"prefix caching {'on' if self.caching else 'off'}, {self.preemption} preemption, {step}"


_POLICY = {"scheduler.schedule_continuous": "continuous", "scheduler.schedule_token_budget": "token_budget"}


def settings(name: str) -> list[Setting]:
    """Every setting the engine runs part `name` in. The lab-01 step runs whole prompts only (later labs' chunked
    runs use the token-budget step); every part meets both kinds of preemption (`EngineConfig.preemption_mode`:
    recompute, swap)."""
    policies = [_POLICY[name]] if name in _POLICY else ["continuous", "token_budget"]
    return [Setting(p, c, m) for c in (False, True) for m in ("recompute", "swap") for p in policies]


# -- random states, driven by the reference -------------------------------------------------------------
def _config(rng: random.Random, name: str, block_size: int, setting: Setting | None) -> EngineConfig:
    if setting is None:  # callers outside the part checks: the part's own lab's switches
        policy = _POLICY.get(name, rng.choice(["continuous", "token_budget"]))
        setting = Setting(policy, PARTS[name].lab >= "04" or name == "block_manager.release", "recompute")
    budget = rng.choice([block_size, 2 * block_size, 4 * block_size, 64]) if setting.chunked else 64
    return EngineConfig(scheduler=setting.policy, max_num_seqs=rng.randint(1, 6), block_size=block_size,
                        max_num_batched_tokens=max(budget, block_size), enable_chunked_prefill=setting.chunked,
                        enable_prefix_caching=setting.caching, preemption_mode=setting.preemption, watermark=0.0)


def _request(rng: random.Random, i: int, shared: list[int]) -> Request:
    n = rng.randint(1, 40)
    head = shared[:rng.randint(8, len(shared))] if rng.random() < 0.7 else []
    ids = (head + [rng.randrange(100) for _ in range(n)])[:48] or [1]
    return Request(str(i), None, ids, SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True), 0.0)


def _advance(sched: Scheduler, out: SchedulerOutput, rng: random.Random) -> None:
    """What the engine does after the model ran: count computed tokens, sample, finish."""
    for req, n in out.scheduled:
        req.num_computed_tokens += n
        sched.bm.commit_full_blocks(req)
        if req.num_computed_tokens == req.num_tokens:
            req.token_ids.append(rng.randrange(100))
            if req.num_output_tokens >= req.params.max_tokens:
                sched.finish(req, Status.FINISHED)


def _swap_out(req: Request) -> None:
    """Swap preemption without a KV cache: the host copy is a record of the blocks it came from (none when the
    blocks were freed before the copy)."""
    req.swapped_kv = ("host copy of", tuple(req.block_table))


def host_copy(req: Request) -> list[int] | None:
    """The blocks `req`'s host copy was taken from (`_swap_out`'s record), None when it is not swapped out."""
    kv = req.swapped_kv
    if kv is None:
        return None
    return list(kv[1]) if isinstance(kv, tuple) and kv[:1] == ("host copy of",) else []


def _swap_in(req: Request) -> None:
    req.swapped_kv = None


def random_state(seed: int, name: str, setting: Setting | None = None) -> Scheduler:
    """A scheduler mid-run: some requests running (prefills and decodes), some waiting, some finished."""
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 8])
    cfg = _config(rng, name, bs, setting)
    bm = BlockManager(rng.randint(4, 40), bs, cfg.enable_prefix_caching, cfg.watermark)
    sched = Scheduler(cfg, bm, _swap_out, _swap_in)
    shared = [rng.randrange(100) for _ in range(24)]
    reqs = [_request(rng, i, shared) for i in range(rng.randint(1, 10))]
    reqs = [r for r in reqs if bm.blocks_needed(r.num_prompt_tokens + r.params.max_tokens) <= bm.num_blocks] or \
        [Request("0", None, [1], SamplingParams(max_tokens=1), 0.0)]
    arrivals = sorted(rng.randint(0, 6) for _ in reqs)
    steps = rng.randint(0, 25)
    for t in range(steps):
        for r, a in zip(reqs, arrivals):
            if a == t:
                sched.add(r)
        _advance(sched, sched.schedule(), rng)
    for r, a in zip(reqs, arrivals):  # arrivals since the last step wait for the next one
        if a >= steps:
            sched.add(r)
    seen = [r for r, a in zip(reqs, arrivals) if a < steps and r.num_computed_tokens >= bs]
    if seen and rng.random() < 0.5:  # a follow-up turn: an earlier prompt again, a few tokens more
        head = seen[rng.randrange(len(seen))].prompt_token_ids
        follow = Request(str(len(reqs)), None, head + [rng.randrange(100) for _ in range(rng.randint(1, 4))],
                         SamplingParams(max_tokens=rng.randint(1, 4), ignore_eos=True), 0.0)
        if bm.blocks_needed(follow.num_prompt_tokens + follow.params.max_tokens) <= bm.num_blocks:
            sched.add(follow)
    return sched


def full_decode_pool(name: str) -> Scheduler:
    """Three requests decoding in a full 6-block pool (block size 4), each at a block boundary: the oldest's next
    token needs a block, so making room for it preempts the newest, which the step must then leave alone. (Random
    states preempt in a step too rarely to count on.)"""
    policy = _POLICY.get(name, "continuous")
    cfg = EngineConfig(scheduler=policy, max_num_seqs=4, block_size=4, max_num_batched_tokens=64,
                       enable_chunked_prefill=policy == "token_budget", enable_prefix_caching=False,
                       preemption_mode="recompute", watermark=0.0)
    sched = Scheduler(cfg, BlockManager(6, 4, False, 0.0), _swap_out, _swap_in)
    for i in range(3):
        req = Request(str(i), None, list(range(1, 9)), SamplingParams(max_tokens=20, ignore_eos=True), 0.0)
        sched.add(req)
        sched.start(req, 8)
        req.num_computed_tokens = 8
        req.token_ids.append(9)
    return sched


def snapshot(sched: Scheduler) -> dict:
    """Everything a part may change, by what the learner calls it."""
    bm = sched.bm
    reqs = {r.request_id: r for r in [*sched.running, *sched.waiting]}
    return {
        "running": [r.request_id for r in sched.running if not r.status.done],
        "waiting": [r.request_id for r in sched.waiting],
        "status": {k: r.status.value for k, r in reqs.items()},
        "num_computed_tokens": {k: r.num_computed_tokens for k, r in reqs.items()},
        "block_tables": {k: list(r.block_table) for k, r in reqs.items()},
        "req.metrics.preemptions": {k: r.metrics.preemptions for k, r in reqs.items()},
        "host copy (req.swapped_kv: the blocks swap_out copied)": {k: host_copy(r) for k, r in reqs.items()},
        "free blocks (free_ids)": sorted(bm.free_ids),
        "cached blocks (evictable, LRU order)": list(bm.evictable),
        "hash_to_block": dict(bm.hash_to_block),
        "ref_counts": [b.ref_count for b in bm.blocks],
        "block names (block.hash, block.token_ids)": {b.block_id: (b.hash, b.token_ids) for b in bm.blocks
                                                      if b.hash is not None or b.token_ids},
        "num_preemptions": sched.num_preemptions,
    }


def first_difference(ref: dict, you: dict) -> tuple[str, object, object] | None:
    """(what, yours, expected), as text, for the first entry of two snapshots that differs, one level deep: a
    request's block table, one block's reference count, the blocks one list has and the other lacks."""
    for key in ref:
        r, y = ref[key], you.get(key)
        if r == y:
            continue
        if isinstance(r, dict) and isinstance(y, dict):
            for k in [*r, *[k for k in y if k not in r]]:
                if k not in r or k not in y or r[k] != y[k]:
                    return (f"{key}[{k!r}]", repr(y[k]) if k in y else "absent",
                            repr(r[k]) if k in r else "absent")
        if key == "ref_counts" and len(r) == len(y):
            i = next(i for i in range(len(r)) if r[i] != y[i])
            return f"the ref_count of block {i}", repr(y[i]), repr(r[i])
        if isinstance(r, list) and isinstance(y, list) and set(r) != set(y):
            extra, lack = sorted(set(y) - set(r)), sorted(set(r) - set(y))
            return key, f"{y}" + (f" (with {extra} too)" if extra else ""), f"{r}" + (f" (with {lack})" if lack else "")
        return key, repr(y), repr(r)
    return None
