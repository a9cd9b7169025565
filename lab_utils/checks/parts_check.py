"""Checks for the engine parts a learner writes (labs 01-04): random cases against the reference, then the
real engine with the learner's part in it.

- `check_part(name, fn)`: builds many random engine states (a scheduler and block pool driven by the reference
  for a random number of steps, no model needed), runs the reference method and the learner's on identical
  copies, and compares what they return and every piece of state they touch, per-request metrics included. The
  states cycle through every setting the engine runs the part in (`settings`: prefix caching off and on,
  preemption by recompute and by swap, a prefill-first step with whole prompts and a token-budget step with
  chunked prefill), so a part that only works with the switches of its own lab fails in that lab.
- A failure names the part, the file it is saved to (`my_engine/<component>.py`), the lab that writes it, the
  setting and the first value that differs. A "likely mistake" line comes only from a diagnoser (`DIAGNOSERS`)
  whose evidence is in that difference; no solution is shown.
- `check_in_engine(parts, lab)`: the real `LLMEngine` on a tiny random model, once with the reference parts and
  once with the learner's, on a random workload sized to make the parts work hard (a small KV pool forces
  preemption): every request must finish, the greedy tokens must be equal, and every KV block must come back.
  When not, each of the learner's parts is checked alone, and the message names the one that is wrong.
"""
from __future__ import annotations

import copy
import random
import types
from dataclasses import dataclass
from typing import Callable

from lab_utils.engine.block_manager import BlockManager
from lab_utils.engine.config import EngineConfig
from lab_utils.course.parts import PARTS, EngineParts, LearnerPartError, check_signature
from lab_utils.engine.request import Request, Status
from lab_utils.engine.sampling_params import SamplingParams
from lab_utils.engine.scheduler import Scheduler, SchedulerOutput


def failure(message: str, part: str, diagnosis: str | None = None) -> AssertionError:
    """The AssertionError a check raises (a notebook shows it as one): `part` names the part; `diagnosis` is the
    id of the diagnoser that explained the difference (None when none had evidence)."""
    err = AssertionError(message)
    err.part, err.diagnosis = part, diagnosis
    return err


def where(name: str) -> str:
    """'scheduler.preempt (lab 02, my_engine/scheduler.py)': the part, the lab that writes it, its saved file."""
    from lab_utils.course.learner_parts import learner_dir

    part = PARTS[name]
    return f"{name} (lab {part.lab}, {learner_dir().name}/{part.component}.py)"


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
    runs use the token-budget step); `preempt` is checked in recompute mode only: lab 02 teaches the recompute
    kind, and no lab runs the learner's parts with swap preemption."""
    policies = [_POLICY[name]] if name in _POLICY else ["continuous", "token_budget"]
    modes = ["recompute"] if name == "scheduler.preempt" else ["recompute", "swap"]
    return [Setting(p, c, m) for c in (False, True) for m in modes for p in policies]


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
    """Swap preemption without a KV cache: the host copy is a record of the blocks it came from."""
    req.swapped_kv = ("host copy of", tuple(req.block_table))


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
        "swapped out (req.swapped_kv is set)": {k: r.swapped_kv is not None for k, r in reqs.items()},
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


def _out(o) -> object:
    if isinstance(o, SchedulerOutput):
        return {"scheduled": [(r.request_id, n) for r, n in o.scheduled],
                "preempted": [r.request_id for r in o.preempted]}
    if isinstance(o, Request):
        return o.request_id
    return o


def _describe_req(r: Request) -> str:
    return (f"request {r.request_id!r} ({r.num_prompt_tokens} prompt + {r.num_output_tokens} output tokens, "
            f"{r.num_computed_tokens} computed, block table {r.block_table}, {r.status.value})")


@dataclass
class Call:
    """What `_call` did: the result, the request or block it was called on, and the step's output it filled."""
    result: object = None
    args: str = ""
    out: SchedulerOutput | None = None
    req_id: str | None = None
    block_id: int | None = None
    req: Request | None = None
    skipped: bool = False


def _call(name: str, fn: Callable, sched: Scheduler, rng: random.Random) -> Call:
    """Call part `name` on `sched` (a method of the scheduler or of its block manager) with args from `rng`."""
    part = PARTS[name]
    target = sched if part.component == "scheduler" else sched.bm
    bound = types.MethodType(fn, target)
    live = [r for r in sched.running if r.status is Status.RUNNING]
    c = Call()
    if part.attr in ("schedule_continuous", "schedule_token_budget"):
        c.args = (f"one step; running {[r.request_id for r in sched.running]}, waiting "
                  f"{[r.request_id for r in sched.waiting]}")
        c.result = bound()
        return c
    if part.attr == "make_room":
        if not live:
            return Call(skipped=True)
        req = live[rng.randrange(len(live))]
        n = req.num_computed_tokens + rng.randint(1, 6 * sched.bm.block_size)
        c.out, c.req_id, c.req = SchedulerOutput(), req.request_id, req
        c.args = f"make_room({_describe_req(req)}, num_tokens={n}); running {[r.request_id for r in live]}"
        c.result = bound(req, n, c.out)
        return c
    if part.attr == "preempt":
        if not live:
            return Call(skipped=True)
        req = live[rng.randrange(len(live))]
        c.req, c.req_id, c.args = req, req.request_id, f"preempt({_describe_req(req)})"
        c.result = bound(req)
        return c
    if part.attr == "grow":
        if live and rng.random() < 0.7:
            req = live[rng.randrange(len(live))]
        else:
            req = Request("new", None, [1] * 8, SamplingParams(), 0.0)
        n = req.num_computed_tokens + rng.randint(0, 4 * sched.bm.block_size)
        c.req, c.req_id = req, req.request_id
        c.args = f"grow({_describe_req(req)}, num_tokens={n}); {sched.bm.num_free_blocks} blocks free or cached"
        c.result = bound(req, n)
        return c
    if part.attr == "release":
        used = [b.block_id for b in sched.bm.blocks if b.ref_count > 0]
        shared = [b for b in used if sched.bm.blocks[b].ref_count > 1]  # the case reference counts exist for
        pick = shared if shared and rng.random() < 0.5 else used
        if not pick:
            return Call(skipped=True)
        bid = pick[rng.randrange(len(pick))]
        blk = sched.bm.blocks[bid]
        c.block_id = bid
        c.args = f"release({bid}); block {bid} has ref_count {blk.ref_count}, " + (
            "a name (it holds a cached prefix)" if blk.hash is not None else "no name")
        c.result = bound(bid)
        return c
    if part.attr == "recycle":
        # a block whose last reference just went: drop it by hand first, then let the part decide its fate
        used = [b for b in sched.bm.blocks if b.ref_count == 1]
        if not used:
            return Call(skipped=True)
        blk = used[rng.randrange(len(used))]
        blk.ref_count = 0
        c.block_id = blk.block_id
        c.args = f"recycle({blk.block_id}); block {blk.block_id} has " + (
            f"the name {blk.hash}" if blk.hash is not None else "no name")
        c.result = bound(blk.block_id)
        return c
    if part.attr == "evict":
        if not sched.bm.evictable:
            return Call(skipped=True)
        c.args = f"evict(); cached blocks, least recently used first: {list(sched.bm.evictable)}"
        c.result = bound()
        return c
    if part.attr == "match_prefix":
        waiting = list(sched.waiting) or [Request("q", None, [rng.randrange(100) for _ in range(20)],
                                                  SamplingParams(), 0.0)]
        req = waiting[rng.randrange(len(waiting))]
        c.req, c.req_id, c.args = req, req.request_id, f"match_prefix({_describe_req(req)})"
        c.result = bound(req)
        return c
    if part.attr == "commit_full_blocks":
        if not live:
            return Call(skipped=True)
        req = live[rng.randrange(len(live))]
        if req.num_computed_tokens < req.num_tokens and rng.random() < 0.5:
            req.num_computed_tokens += 1  # a token just computed: its block may have become full
        c.req, c.req_id, c.args = req, req.request_id, f"commit_full_blocks({_describe_req(req)})"
        c.result = bound(req)
        return c
    if part.attr == "hash_block":
        parent = rng.choice([None, rng.randrange(1 << 30)])
        ids = tuple(rng.randrange(100) for _ in range(sched.bm.block_size))
        c.args = f"hash_block({parent}, {ids})"
        c.result = bound(parent, ids)
        return c
    raise KeyError(name)


# -- diagnosers: a named mistake, said only when the difference shows it --------------------------------------
@dataclass
class Evidence:
    """Everything one failed case shows: the states before and after (reference `a`, yours `b`), their snapshots,
    both calls, and what the engine's guard said about your result (`error`)."""
    name: str
    before: dict
    ref: dict
    you: dict
    ref_call: Call
    you_call: Call
    a: Scheduler
    b: Scheduler
    error: str | None = None

    def req(self, sched: Scheduler) -> Request | None:
        call = self.ref_call if sched is self.a else self.you_call
        return call.req

    @property
    def caching(self) -> bool:
        return self.a.bm.enable_prefix_caching

    def only_diff(self, key: str) -> bool:
        return [k for k in self.ref if self.ref[k] != self.you[k]] == [key] and \
            _out(self.ref_call.result) == _out(self.you_call.result)

    def scheduled(self, who: str) -> dict[str, int]:
        res = (self.ref_call if who == "ref" else self.you_call).result
        return {r.request_id: n for r, n in res.scheduled} if isinstance(res, SchedulerOutput) else {}

    def admitted(self, who: str) -> list[str]:
        """Requests the step started (waiting before it, or preempted in it and back), in step order."""
        back = self.preempted(who)
        return [rid for rid in self.scheduled(who) if rid not in self.before["running"] or rid in back]

    def preempted(self, who: str) -> list[str]:
        call = self.ref_call if who == "ref" else self.you_call
        res = call.out if call.out is not None else call.result
        return [r.request_id for r in res.preempted] if isinstance(res, SchedulerOutput) else []


@dataclass(frozen=True)
class Diagnoser:
    id: str
    parts: tuple[str, ...]  # attribute names it applies to, e.g. ("preempt",)
    evidence: Callable[[Evidence], bool]
    text: str


def _bad_start(ev: Evidence) -> bool:
    res = ev.you_call.result
    return bool(ev.error) and isinstance(res, SchedulerOutput) and any(
        r.num_cached_tokens > 0 and n > r.num_tokens - r.num_computed_tokens for r, n in res.scheduled)


def _mixed(ev: Evidence) -> bool:
    you = ev.scheduled("you")
    decodes = [rid for rid, n in you.items() if rid in ev.before["running"] and n == 1]
    return bool(decodes) and bool(ev.admitted("you")) and not (ev.admitted("ref") and any(
        rid in ev.before["running"] for rid in ev.scheduled("ref")))


def _not_fcfs(ev: Evidence) -> bool:
    you = [rid for rid in ev.admitted("you") if rid in ev.before["waiting"]]
    return bool(you) and you != ev.before["waiting"][:len(you)]


def _admitted_over_running(ev: Evidence) -> bool:
    ref, you = ev.scheduled("ref"), ev.scheduled("you")
    left_out = [rid for rid in ref if rid in ev.before["running"] and rid not in you]
    return bool(left_out) and bool(ev.admitted("you")) and not ev.preempted("ref")


def _admitted_after_preempt(ev: Evidence) -> bool:
    return bool(ev.preempted("ref")) and bool(ev.admitted("you")) and not ev.admitted("ref")


def _unchunked(ev: Evidence) -> bool:
    ref, you = ev.scheduled("ref"), ev.scheduled("you")
    a = {r.request_id: r for r in ev.a.running}
    chunked = [rid for rid in ev.admitted("ref") if ref[rid] < a[rid].num_tokens - a[rid].num_computed_tokens]
    return any(rid not in you for rid in chunked)


def _prompt_chunk_dropped(ev: Evidence) -> bool:
    ref, you = ev.scheduled("ref"), ev.scheduled("you")
    return any(n > 1 and rid in ev.before["running"] and you.get(rid, 0) < n for rid, n in ref.items())


def _victim(ev: Evidence) -> bool:
    ref, you = ev.preempted("ref"), ev.preempted("you")
    return bool(ref) and bool(you) and ref[0] != you[0]


def _unrecorded_victims(ev: Evidence) -> bool:
    return bool(ev.preempted("ref")) and not ev.preempted("you") and ev.you["running"] != ev.before["running"]


def _gave_way_true(ev: Evidence) -> bool:
    return ev.ref_call.result is False and ev.you_call.result is True and \
        ev.preempted("ref") == ev.preempted("you")


def _too_few_victims(ev: Evidence) -> bool:
    ref, you = ev.preempted("ref"), ev.preempted("you")
    return 0 < len(you) < len(ref) and ref[:len(you)] == you


def _victim_state(ev: Evidence, key: str):
    rid = ev.you_call.req_id
    return ev.ref[key].get(rid), ev.you[key].get(rid)


def _not_reset(ev: Evidence) -> bool:
    ref, you = _victim_state(ev, "num_computed_tokens")
    return ref == 0 and you not in (0, None)


def _not_freed(ev: Evidence) -> bool:
    ref, you = _victim_state(ev, "block_tables")
    return ref == [] and (bool(you) or ev.ref["ref_counts"] != ev.you["ref_counts"])


def _not_front(ev: Evidence) -> bool:
    rid = ev.you_call.req_id
    return ev.ref["waiting"][:1] == [rid] and rid in ev.you["waiting"] and ev.you["waiting"][:1] != [rid]


def _still_running(ev: Evidence) -> bool:
    return ev.you_call.req_id in ev.you["running"] and ev.you_call.req_id not in ev.ref["running"]


def _grow_changed_on_false(ev: Evidence) -> bool:
    return ev.ref_call.result is False and (ev.you_call.result is not False or ev.you != ev.ref)


def _grow_count(ev: Evidence) -> bool:
    a, b = ev.ref_call.req, ev.you_call.req
    return a is not None and b is not None and len(a.block_table) != len(b.block_table)


def _grow_no_take_block(ev: Evidence) -> bool:
    a, b = ev.ref_call.req, ev.you_call.req
    return a is not None and b is not None and len(a.block_table) == len(b.block_table) and ev.ref != ev.you


def _block(ev: Evidence) -> int | None:
    return ev.you_call.block_id


def _place(snap: dict, bid: int) -> str:
    if bid in snap["cached blocks (evictable, LRU order)"]:
        return "cached"
    return "free" if bid in snap["free blocks (free_ids)"] else "nowhere"


def _dropped_all_refs(ev: Evidence) -> bool:
    bid = _block(ev)
    return bid is not None and ev.before["ref_counts"][bid] > 1 and ev.you["ref_counts"][bid] != \
        ev.before["ref_counts"][bid] - 1


def _recycle_skipped(ev: Evidence) -> bool:
    bid = _block(ev)
    return bid is not None and ev.before["ref_counts"][bid] == 1 and ev.you["ref_counts"][bid] == 0 and (
        _place(ev.ref, bid) != _place(ev.you, bid) or ev.ref["block names (block.hash, block.token_ids)"] !=
        ev.you["block names (block.hash, block.token_ids)"])


def _recycled_too_early(ev: Evidence) -> bool:
    bid = _block(ev)
    return bid is not None and ev.you["ref_counts"][bid] == ev.ref["ref_counts"][bid] > 0 and \
        _place(ev.you, bid) != "nowhere"


def _named_blocks(snap: dict) -> dict:
    return snap["block names (block.hash, block.token_ids)"]


def _named_with_caching_off(ev: Evidence) -> bool:
    return not ev.caching and (len(_named_blocks(ev.you)) > len(_named_blocks(ev.ref))
                               or len(ev.you["hash_to_block"]) > len(ev.ref["hash_to_block"]))


def _names_without_ids(ev: Evidence) -> bool:
    ref, you = _named_blocks(ev.ref), _named_blocks(ev.you)
    return any(b in ref and you[b][0] == ref[b][0] and you[b][1] != ref[b][1] for b in you)


def _overwrote_name(ev: Evidence) -> bool:
    ref, you = ev.ref["hash_to_block"], ev.you["hash_to_block"]
    return any(h in ref and ref[h] != you[h] and ev.before["hash_to_block"].get(h) == ref[h] for h in you)


def _named_uncomputed(ev: Evidence) -> bool:
    req = ev.you_call.req
    if req is None:
        return False
    full = min(req.num_computed_tokens, req.num_tokens) // ev.b.bm.block_size
    ref = _named_blocks(ev.ref)
    return any(bid in _named_blocks(ev.you) and bid not in ref for bid in req.block_table[full:])


def _unchained(ev: Evidence) -> bool:
    ref, you = _named_blocks(ev.ref), _named_blocks(ev.you)
    return any(b in ref and you[b][0] != ref[b][0] and you[b][1] == ref[b][1] for b in you)


def _matched_with_caching_off(ev: Evidence) -> bool:
    return not ev.caching and bool(ev.you_call.result)


def _matched_whole_prompt(ev: Evidence) -> bool:
    req, you, ref = ev.you_call.req, ev.you_call.result, ev.ref_call.result
    return isinstance(you, list) and req is not None and len(you) > len(ref) and \
        len(you) * ev.b.bm.block_size >= req.num_prompt_tokens


def _matched_other_tokens(ev: Evidence) -> bool:
    """A block in your result that its position's chained name leads to, holding other tokens (a collision)."""
    req, you, bm = ev.you_call.req, ev.you_call.result, ev.b.bm
    if not isinstance(you, list) or req is None:
        return False
    name, bs = None, bm.block_size
    for i, bid in enumerate(you):
        ids = tuple(req.prompt_token_ids[i * bs:(i + 1) * bs])
        name = BlockManager.hash_block(bm, name, ids)
        if bm.hash_to_block.get(name) == bid and bm.blocks[bid].token_ids != ids:
            return True
    return False


def _matched_too_few(ev: Evidence) -> bool:
    you, ref = ev.you_call.result, ev.ref_call.result
    return isinstance(you, list) and len(you) < len(ref) and ref[:len(you)] == you


def _matched_past_a_miss(ev: Evidence) -> bool:
    you, ref = ev.you_call.result, ev.ref_call.result
    return isinstance(you, list) and len(you) > len(ref) and you[:len(ref)] == ref


def _freed_cached(ev: Evidence) -> bool:
    bid = _block(ev)
    return bid is not None and _place(ev.ref, bid) == "cached" and _place(ev.you, bid) == "free"


def _cached_at_front(ev: Evidence) -> bool:
    bid = _block(ev)
    return bid is not None and _place(ev.ref, bid) == _place(ev.you, bid) == "cached" and \
        ev.ref["cached blocks (evictable, LRU order)"] != ev.you["cached blocks (evictable, LRU order)"]


def _cached_a_duplicate(ev: Evidence) -> bool:
    bid = _block(ev)
    return bid is not None and _place(ev.ref, bid) == "free" and _place(ev.you, bid) == "cached"


def _kept_name(ev: Evidence) -> bool:
    bid = _block(ev)
    return bid is not None and bid not in _named_blocks(ev.ref) and bid in _named_blocks(ev.you)


def _evicted_other(ev: Evidence) -> bool:
    return ev.you_call.result != ev.ref_call.result


_FORGET = ("the evicted block must forget its name: drop it from self.hash_to_block and clear block.hash and "
           "block.token_ids, or a later prompt would hit a block that now holds other tokens")

DIAGNOSERS: list[Diagnoser] = [
    # the scheduling steps (labs 01 and 03)
    Diagnoser("start_return", ("schedule_continuous", "schedule_token_budget"), _bad_start,
              "n = self.start(req, n): start attaches the blocks the prefix cache already holds for the prompt and "
              "returns how many tokens are left to compute, fewer than you asked for; schedule that number"),
    Diagnoser("fcfs", ("schedule_continuous", "schedule_token_budget"), _not_fcfs,
              "first come, first served: admit from the head of the queue (self.waiting[0]) and stop at the first "
              "request that does not fit; nobody overtakes it"),
    Diagnoser("prefill_first", ("schedule_continuous",), _mixed,
              "a prefill-first step runs either prompts or decodes, never both: decode the running requests only "
              "when no prompt was admitted"),
    Diagnoser("no_admit_after_preempt", ("schedule_token_budget",), _admitted_after_preempt,
              "when make_room had to preempt (out.preempted is not empty), memory is short: admit no new request "
              "in this step (the preempted one would take the blocks straight back)"),
    Diagnoser("running_first", ("schedule_token_budget",), _admitted_over_running,
              "running requests come first: each running request gets its tokens (a decode 1, an unfinished prompt "
              "its next chunk) before any new prompt is admitted; new prompts take what is left of the budget"),
    Diagnoser("prompt_chunk", ("schedule_token_budget",), _prompt_chunk_dropped,
              "a running request still in its prompt takes its next chunk, min(tokens left, budget), not 1 token: "
              "running means decode or unfinished prefill"),
    Diagnoser("chunk_last", ("schedule_token_budget",), _unchunked,
              "the last prompt admitted is chunked to fit the budget: n = min(tokens left, budget), not skipped"),
    # the allocator (lab 02)
    Diagnoser("grow_no_change", ("grow",), _grow_changed_on_false,
              "when the pool cannot cover num_tokens, return False and change nothing (check before taking any "
              "block)"),
    Diagnoser("grow_count", ("grow",), _grow_count,
              "take exactly the missing blocks: blocks_needed(num_tokens) - len(req.block_table), none when the "
              "table already covers num_tokens"),
    Diagnoser("grow_take_block", ("grow",), _grow_no_take_block,
              "take each block with self.take_block(): it sets the block's ref_count to 1 and, when no block is "
              "free, evicts the least recently used cached one"),
    Diagnoser("release_last_ref", ("release",), _dropped_all_refs,
              "a block is reused only when its last reference is gone: release drops one reference "
              "(ref_count -= 1), and other requests may still hold the block"),
    Diagnoser("release_early", ("release",), _recycled_too_early,
              "only the last reference hands a block on: call self.recycle(block_id) when ref_count reaches 0, "
              "not before"),
    Diagnoser("release_recycle", ("release",), _recycle_skipped,
              "when the last reference goes, hand the block to self.recycle(block_id): it keeps a block that holds "
              "a named prefix in the cache and frees the others (do not put it in free_ids yourself)"),
    # preemption (lab 02)
    Diagnoser("victim_newest", ("make_room",), _victim,
              "the victim is the newest running request (self.running[-1]): it has the least work to lose"),
    Diagnoser("victims_recorded", ("make_room",), _unrecorded_victims,
              "append each victim to out.preempted: the step reports whom it preempted"),
    Diagnoser("gave_way", ("make_room",), _gave_way_true,
              "when the victim is req itself, it gave way: return False (it is back in the queue, not scheduled)"),
    Diagnoser("preempt_until_fits", ("make_room",), _too_few_victims,
              "one victim may not free enough: keep preempting (a loop) until self.bm.grow(req, num_tokens) "
              "succeeds or req itself gave way"),
    Diagnoser("preempt_off_batch", ("preempt",), _still_running,
              "take the request off the batch: self.running.remove(req)"),
    Diagnoser("preempt_free", ("preempt",), _not_freed,
              "free the request's blocks with self.bm.free(req): every reference it holds goes back"),
    Diagnoser("preempt_reset", ("preempt",), _not_reset,
              "recompute preemption starts over: req.num_computed_tokens = 0 and req.status = Status.WAITING (its "
              "KV is gone)"),
    Diagnoser("preempt_front", ("preempt",), _not_front,
              "a preempted request goes to the front of the queue (self.waiting.appendleft(req)): it arrived before "
              "everyone still waiting"),
    Diagnoser("preempt_request_count", ("preempt",), lambda ev: ev.only_diff("req.metrics.preemptions"),
              "count the preemption on the request too: req.metrics.preemptions += 1 (the per-request count the "
              "engine reports), besides self.num_preemptions"),
    Diagnoser("preempt_count", ("preempt",), lambda ev: ev.only_diff("num_preemptions"),
              "count the preemption on the scheduler too: self.num_preemptions += 1"),
    # the prefix cache (lab 04)
    Diagnoser("commit_caching_off", ("commit_full_blocks",), _named_with_caching_off,
              "with enable_prefix_caching off, commit_full_blocks names nothing (return at once): otherwise the "
              "engine's 'caching off' runs cache too"),
    Diagnoser("commit_uncomputed", ("commit_full_blocks",), _named_uncomputed,
              "name only blocks whose tokens are all computed: min(req.num_computed_tokens, req.num_tokens) // "
              "block_size of them"),
    Diagnoser("commit_token_ids", ("commit_full_blocks",), _names_without_ids,
              "store each block's token ids with its name (block.token_ids = ids): match_prefix compares them to "
              "tell a hit from a hash collision, so a block without them never hits"),
    Diagnoser("commit_setdefault", ("commit_full_blocks",), _overwrote_name,
              "a name already in self.hash_to_block keeps the block it leads to (self.hash_to_block.setdefault): "
              "the same tokens computed twice give two blocks with one name, and the cached one must stay findable"),
    Diagnoser("commit_chain", ("commit_full_blocks",), _unchained,
              "chain the names: block i's name is self.hash_block(name of block i-1, its token ids), starting "
              "from None"),
    Diagnoser("match_caching_off", ("match_prefix",), _matched_with_caching_off,
              "with enable_prefix_caching off, match_prefix finds nothing (return []): otherwise the engine's "
              "'caching off' runs cache too"),
    Diagnoser("match_whole_prompt", ("match_prefix",), _matched_whole_prompt,
              "leave at least one prompt token to compute (match at most (num_prompt_tokens - 1) // block_size "
              "blocks): the step that computes the last prompt token produces the logits of the first output token"),
    Diagnoser("match_collision", ("match_prefix",), _matched_other_tokens,
              "equal names almost always mean equal tokens, but not always: compare the cached block's token_ids "
              "(self.blocks[bid].token_ids) with the prompt's, and treat a difference as a miss"),
    Diagnoser("match_walk", ("match_prefix",), _matched_too_few,
              "walk the prompt's full blocks in order, chaining the names (name = self.hash_block(previous name, "
              "ids)), and keep each block id while the lookup in self.hash_to_block hits"),
    Diagnoser("match_stop", ("match_prefix",), _matched_past_a_miss,
              "stop at the first block that misses: a later block with equal tokens was computed after another "
              "past"),
    Diagnoser("recycle_keep", ("recycle",), _freed_cached,
              "a block that holds a named prefix (self.hash_to_block[block.hash] == block_id) stays cached: put it "
              "at the end of self.evictable, not in free_ids, so a later prompt can still hit it"),
    Diagnoser("recycle_lru_end", ("recycle",), _cached_at_front,
              "a recycled block is the most recently used: it goes to the end of self.evictable, not the front"),
    Diagnoser("recycle_duplicate", ("recycle",), _cached_a_duplicate,
              "a block is cached only if its name leads to it (self.hash_to_block.get(block.hash) == block_id); "
              "a duplicate no lookup can find is freed"),
    Diagnoser("recycle_forget", ("recycle",), _kept_name,
              "a freed block forgets its name (block.hash = None, block.token_ids = ()): its slots will hold other "
              "tokens"),
    Diagnoser("evict_lru", ("evict",), _evicted_other,
              "you evicted another block than the least recently used one: take the front of self.evictable; the "
              "end holds the most recently used"),
    Diagnoser("evict_forget", ("evict",), lambda ev: ev.you_call.result == ev.ref_call.result, _FORGET),
]


def diagnose(ev: Evidence) -> Diagnoser | None:
    """The first diagnoser of this part whose evidence holds, else None."""
    attr = PARTS[ev.name].attr
    for d in DIAGNOSERS:
        if attr in d.parts:
            try:
                if d.evidence(ev):
                    return d
            except (KeyError, IndexError, TypeError, AttributeError):
                continue
    return None


# -- comparing one call --------------------------------------------------------------------------------------
def _extras(c: Call) -> dict:
    """What a call changed beyond the scheduler: the victims it reported, the request it was given."""
    extra = {}
    if c.out is not None:
        extra["out.preempted"] = [r.request_id for r in c.out.preempted]
    if c.req is not None:
        extra["req.block_table (the request it was given)"] = list(c.req.block_table)
        extra["req.num_computed_tokens"] = c.req.num_computed_tokens
    return extra


def compare_call(name: str, fn: Callable, state: Scheduler, call: Callable[[Callable, Scheduler], Call],
                 what: str) -> bool:
    """Run `call(reference, s)` and `call(fn, s)` on copies of `state`. Raises an AssertionError (`failure`) naming the part,
    `what` (the case), the first difference and, where a diagnoser has evidence, the likely mistake. Returns
    False when the case did not apply (nothing to call it on)."""
    part = PARTS[name]
    reference = getattr(Scheduler if part.component == "scheduler" else BlockManager, part.attr)
    before = snapshot(state)
    a, b = copy.deepcopy(state), copy.deepcopy(state)
    ref_call = call(reference, a)
    if ref_call.skipped:
        return False
    error, you_call = None, Call()
    try:
        you_call = call(fn, b)
        raw = you_call.result
        if part.attr.startswith("schedule_"):
            if not isinstance(raw, SchedulerOutput):
                raise LearnerPartError(f"return the step as a SchedulerOutput, not {type(raw).__name__}")
            stale = [r.request_id for r in b.running if r.status.done]
            if stale:
                raise LearnerPartError(f"requests {stale} had ended but are still in self.running after your "
                                       f"step: retire finished requests (status.done) first, they hold batch slots")
            b._check(raw, part.attr)
            b.running = [r for r in b.running if not r.status.done]
    except NotImplementedError:
        raise
    except LearnerPartError as err:
        error = str(err)
    except Exception as err:
        raise failure(f"{where(name)}, {what}: your function raised {type(err).__name__}: {err}\n"
                      f"  called: {ref_call.args}", name) from err
    if error is None:
        ref_s, you_s = {**snapshot(a), **_extras(ref_call)}, {**snapshot(b), **_extras(you_call)}
        ref_out, you_out = _out(ref_call.result), _out(you_call.result)
        if you_out == ref_out and you_s == ref_s:
            return True
        if you_out != ref_out:
            wrong = f"it returned {you_out!r}; expected {ref_out!r}"
        else:
            key, y, r = first_difference(ref_s, you_s)
            wrong = f"afterwards {key} is {y}; expected {r}"
    else:
        ref_s, you_s = snapshot(a), snapshot(b)
        wrong = error
    ev = Evidence(name, before, ref_s, you_s, ref_call, you_call, a, b, error)
    d = diagnose(ev)
    raise failure(f"{where(name)}, {what}: {wrong}\n  called: {ref_call.args}"
                  + (f"\n  likely mistake: {d.text}" if d else ""), name, d.id if d else None)


def check_part(name: str, fn: Callable, trials: int = 150, seed: int = 0) -> int:
    """Compare `fn` with the reference part `name` on `trials` random states, cycling through every setting the
    engine runs it in (`settings`). Returns the number of cases."""
    check_signature(name, fn)
    part = PARTS[name]
    if part.component == "attention":
        return _check_slot_mapping(fn, trials, seed)
    if part.component == "engine":
        return _check_stop_reason(fn, trials, seed)
    cases, kinds = 0, settings(name)
    for trial in range(trials):
        setting = kinds[trial % len(kinds)]
        state = random_state(seed * 100_000 + trial, name, setting)
        cases += compare_call(name, fn, state, lambda f, s, t=trial: _call(name, f, s, random.Random(t)),
                              f"case {trial} ({setting})")
    print(f"{name}: {cases} random cases agree with the reference, in {len(kinds)} settings (prefix caching off and "
          f"on{', recompute and swap preemption' if len({k.preemption for k in kinds}) > 1 else ''}"
          f"{', whole prompts and chunked prefill' if len({k.policy for k in kinds}) > 1 else ''})")
    return cases


def _check_stop_reason(fn: Callable, trials: int, seed: int) -> int:
    from lab_utils.engine.engine import stop_reason

    rng = random.Random(seed)
    eos = {2}
    for trial in range(trials):
        prompt = [rng.randrange(3, 50) for _ in range(rng.randint(1, 12))]
        params = SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=rng.random() < 0.3,
                                stop_token_ids=rng.choice([[], [7], [7, 9]]))
        req = Request(str(trial), None, prompt, params, 0.0)
        for _ in range(rng.randint(1, params.max_tokens)):
            req.token_ids.append(rng.choice([2, 7, 9, rng.randrange(3, 50)]))
        token = req.token_ids[-1]
        max_model_len = rng.choice([req.num_tokens, req.num_tokens + 1, req.num_tokens + 20])
        want = stop_reason(req, token, set(eos), max_model_len)
        got = fn(req, token, set(eos), max_model_len)
        if got != want:
            hint = ("an end token does not stop a request with ignore_eos=True" if params.ignore_eos and token in eos
                    else "a token in params.stop_token_ids stops the request ('stop')" if token in params.stop_token_ids
                    else "'length': max_tokens counts output tokens only (req.num_output_tokens), and the whole "
                         "sequence may not exceed max_model_len" if want == "length" or got == "length"
                    else "an end token stops the request with 'stop'")
            raise AssertionError(
                f"{where('engine.stop_reason')}, case {trial}: returned {got!r}, expected {want!r} for token {token} "
                f"(eos_ids={sorted(eos)}, ignore_eos={params.ignore_eos}, stop_token_ids={params.stop_token_ids}, "
                f"{req.num_output_tokens} of max_tokens={params.max_tokens} output tokens, {req.num_tokens} tokens "
                f"of max_model_len={max_model_len})\n  likely mistake: {hint}")
    print(f"engine.stop_reason: {trials} random cases agree with the reference")
    return trials


def _check_slot_mapping(fn: Callable, trials: int, seed: int) -> int:
    from lab_utils.engine.attention import slot_mapping

    rng = random.Random(seed)
    for trial in range(trials):
        bs = rng.choice([1, 2, 4, 16])
        tables, ctx, q = [], [], []
        pool = list(range(256))
        rng.shuffle(pool)
        for _ in range(rng.randint(1, 4)):
            c = rng.randint(1, 40)
            n = -(-c // bs)
            tables.append([pool.pop() for _ in range(n)])
            ctx.append(c)
            q.append(rng.choice([1, c, rng.randint(1, c)]))
        want = slot_mapping(tables, ctx, q, bs)
        got = fn([list(t) for t in tables], list(ctx), list(q), bs)
        got = [int(x) for x in got]
        if got != want:
            if len(got) != len(want):
                raise AssertionError(f"{where('attention.slot_mapping')}, case {trial}: {len(got)} slots for {len(want)} new "
                                     f"tokens (query_lens={q}): one slot per token the step computes")
            i = next(k for k in range(len(want)) if got[k] != want[k])
            raise AssertionError(
                f"{where('attention.slot_mapping')}, case {trial}: slot {i} is {got[i]}, expected {want[i]} "
                f"(block_size={bs}, block_tables={tables}, context_lens={ctx}, query_lens={q}); a sequence's new "
                f"tokens are its last query_len positions, and position p is at offset p % block_size of block "
                f"table[p // block_size]")
    print(f"attention.slot_mapping: {trials} random cases agree with the reference")
    return trials


# -- the real engine with the learner's parts -----------------------------------------------------------
def _lab_check(name: str) -> Callable[[Callable], None]:
    """How the lab that teaches part `name` checks it (its hand-built cases too), without saving it."""
    from lab_utils.checks import lab03, lab04

    special = {"scheduler.schedule_token_budget": lab03.check_schedule_token_budget,
               "block_manager.hash_block": lab04.check_hash_block,
               "block_manager.match_prefix": lab04.check_match_prefix,
               "block_manager.commit_full_blocks": lab04.check_commit_full_blocks,
               "block_manager.recycle": lab04.check_recycle, "block_manager.evict": lab04.check_evict}
    if name in special:
        return lambda fn: special[name](fn, submit=False)
    return lambda fn: check_part(name, fn)


def blame(parts: EngineParts) -> str:
    """Which of the learner's parts is wrong on its own: each is checked as its lab checks it (in every setting),
    in lab order; the first that fails is named with its first wrong value."""
    import contextlib
    import io

    mine = sorted((n for n in parts.overrides if n in PARTS and PARTS[n].lab <= "04"), key=lambda n: (PARTS[n].lab, n))
    for name in mine:
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                _lab_check(name)(parts.overrides[name])
        except NotImplementedError:
            continue
        except AssertionError as err:
            return f"\nthe cause: {err}"
    if not mine:
        return ""
    return ("\neach of your parts (" + ", ".join(where(n) for n in mine) + ") agrees with the engine's on its own, "
            "so the difference comes from how they work together")


def check_in_engine(parts: EngineParts, lab: str, num_requests: int = 24, seed: int = 0) -> dict:
    """The engine as of `lab`, on a tiny random model: reference parts vs `parts`, same random workload.
    Every request finishes, greedy tokens are equal, every block comes back. Returns what it measured. When
    not, the message names the part that is wrong on its own (`blame`)."""
    try:
        return _run_in_engine(parts, lab, num_requests, seed)
    except AssertionError as err:
        raise AssertionError(f"{err}{blame(parts)}") from None


def _run_in_engine(parts: EngineParts, lab: str, num_requests: int, seed: int) -> dict:
    from lab_utils.engine.engine import LLMEngine
    from lab_utils.course.learner_parts import engine_config
    from lab_utils.models.loader import build_random
    from lab_utils.models.registry import REGISTRY

    rng = random.Random(seed)
    # token ids in, token ids out: no tokenizer (loading one imports most of transformers, seconds per lab)
    model, tok = build_random(REGISTRY["tiny-random"].config, seed=0).eval(), None
    vocab = model.config.vocab_size
    shared = [rng.randrange(vocab) for _ in range(40)]
    prompts, params = [], []
    for i in range(num_requests):
        head = shared[:rng.choice([0, 8, 17, 32, 40])] if lab >= "04" else []
        if lab >= "04" and i % 3 == 2:  # the shared prefix with a gap: later blocks sit at other positions
            head = shared[:8] + shared[16:32]
        prompts.append(head + [rng.randrange(vocab) for _ in range(rng.randint(1, 30))])
        # seeded sampling from a random model's nearly flat distribution: any wrong K/V changes the tokens
        params.append(SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True, temperature=1.0, seed=i))
    sizes = dict(max_num_seqs=6, block_size=4, max_model_len=96, watermark=0.0)
    if lab == "01":
        cfg_kwargs = dict(kv_cache_memory_bytes=None, num_gpu_blocks=4, max_num_batched_tokens=96)
    else:
        cfg_kwargs = dict(num_gpu_blocks=40, max_num_batched_tokens=32 if lab >= "03" else 96)
    results = {}
    for who, p in (("reference", EngineParts()), ("yours", parts)):
        engine = LLMEngine((model, tok), engine_config(lab, **sizes, **cfg_kwargs), device="cpu", parts=p)
        try:
            outs = engine.generate(prompts, params)
        except LearnerPartError as err:
            raise AssertionError(f"the engine (lab {lab} configuration) with your parts stopped: {err}") from None
        unfinished = [o.request_id for o in outs if not o.finished]
        assert not unfinished, f"with your parts, requests {unfinished} never finished"
        try:
            engine.block_manager.check_all_free()
        except AssertionError as err:
            raise AssertionError(f"with {who} parts, KV blocks leaked after every request ended: {err}") from None
        stats = engine.stats()
        stats["req.metrics.preemptions"] = {o.request_id: o.metrics.preemptions for o in outs}
        stats["req.num_cached_tokens"] = {o.request_id: o.num_cached_tokens for o in outs}
        results[who] = ([o.token_ids for o in outs], stats)
    ref_tokens, ref_stats = results["reference"]
    you_tokens, you_stats = results["yours"]
    bad = [i for i, (a, b) in enumerate(zip(ref_tokens, you_tokens)) if a != b]
    assert not bad, (f"with your parts the engine generated different tokens for {len(bad)} of {num_requests} "
                     f"requests (first: request {bad[0]}: {you_tokens[bad[0]][:8]}... vs the reference's "
                     f"{ref_tokens[bad[0]][:8]}...)")
    for key, what in (("num_steps", "engine steps"), ("num_preemptions", "preemptions"),
                      ("prefix_cache_hit_rate", "prefix-cache hit rate"),
                      ("req.metrics.preemptions", "preemptions per request"),
                      ("req.num_cached_tokens", "prompt tokens served by the prefix cache, per request")):
        if you_stats[key] != ref_stats[key]:
            r, y = ref_stats[key], you_stats[key]
            if isinstance(r, dict):  # the first request that differs, not the whole table
                rid = next(k for k in r if r[k] != y.get(k))
                r, y, what = r[rid], y.get(rid), f"{what}: request {rid} has"
            raise AssertionError(f"with your parts the engine took other decisions than the reference's on the "
                                 f"same requests: {what} {y} vs {r}")
    summary = {"requests": num_requests, "finished": num_requests, "tokens_equal": True, "blocks_leaked": 0,
               "preemptions": you_stats["num_preemptions"], "steps": you_stats["num_steps"],
               "reference_steps": ref_stats["num_steps"], "prefix_cache_hit_rate": you_stats["prefix_cache_hit_rate"]}
    print(f"the real engine (lab {lab} configuration, tiny model) ran your parts: {num_requests} requests finished, "
          f"tokens equal to the reference's, 0 blocks leaked, {summary['preemptions']} preemptions, "
          f"{summary['steps']} steps (reference: {summary['reference_steps']})")
    return summary


# every check_* above also records its result in the learner's own log (lab_utils.workshop.records)
from lab_utils.workshop.records import record_checks  # noqa: E402

record_checks(globals())
