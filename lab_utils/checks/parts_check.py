"""Checks for the engine parts a learner writes (labs 01-04): random cases against the reference, then the
real engine with the learner's part in it.

- `check_part(name, fn)`: builds many random engine states (a scheduler and block pool driven by the reference
  for a random number of steps, no model needed), runs the reference method and the learner's on identical
  copies, and compares what they return and every piece of state they touch. The first difference is reported
  with the state it came from and, where the pattern is a known mistake, its name. No solution is shown.
- `check_in_engine(parts, lab)`: the real `LLMEngine` on a tiny random model, once with the reference parts and
  once with the learner's, on a random workload sized to make the part work hard (a small KV pool forces
  preemption): every request must finish, the greedy tokens must be equal, and every KV block must come back.
"""
from __future__ import annotations

import copy
import random
import types
from typing import Callable

from lab_utils.engine.block_manager import BlockManager
from lab_utils.engine.config import EngineConfig
from lab_utils.engine.parts import PARTS, EngineParts, LearnerPartError, check_signature
from lab_utils.engine.request import Request, Status
from lab_utils.engine.sampling_params import SamplingParams
from lab_utils.engine.scheduler import Scheduler, SchedulerOutput

_POLICY = {"scheduler.schedule_continuous": "continuous", "scheduler.schedule_token_budget": "token_budget"}


# -- random states, driven by the reference -------------------------------------------------------------
def _config(rng: random.Random, name: str, block_size: int) -> EngineConfig:
    policy = _POLICY.get(name, rng.choice(["continuous", "token_budget"]))
    chunked = policy == "token_budget"
    budget = rng.choice([block_size, 2 * block_size, 4 * block_size, 64]) if chunked else 64
    return EngineConfig(scheduler=policy, max_num_seqs=rng.randint(1, 6), block_size=block_size,
                        max_num_batched_tokens=max(budget, block_size), enable_chunked_prefill=chunked,
                        enable_prefix_caching=PARTS[name].lab >= "04" or name == "block_manager.release",
                        watermark=0.0)


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


def random_state(seed: int, name: str) -> Scheduler:
    """A scheduler mid-run: some requests running (prefills and decodes), some waiting, some finished."""
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 8])
    cfg = _config(rng, name, bs)
    bm = BlockManager(rng.randint(4, 40), bs, cfg.enable_prefix_caching, cfg.watermark)
    sched = Scheduler(cfg, bm)
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
    return sched


def snapshot(sched: Scheduler) -> dict:
    bm = sched.bm
    reqs = {r.request_id: r for r in [*sched.running, *sched.waiting]}
    return {
        "running": [r.request_id for r in sched.running if not r.status.done],
        "waiting": [r.request_id for r in sched.waiting],
        "status": {k: r.status.value for k, r in reqs.items()},
        "num_computed_tokens": {k: r.num_computed_tokens for k, r in reqs.items()},
        "block_tables": {k: list(r.block_table) for k, r in reqs.items()},
        "free blocks (free_ids)": sorted(bm.free_ids),
        "cached blocks (evictable, LRU order)": list(bm.evictable),
        "hash_to_block": dict(bm.hash_to_block),
        "ref_counts": [b.ref_count for b in bm.blocks],
        "num_preemptions": sched.num_preemptions,
    }


def _out(o) -> object:
    if isinstance(o, SchedulerOutput):
        return {"scheduled": [(r.request_id, n) for r, n in o.scheduled],
                "preempted": [r.request_id for r in o.preempted]}
    if isinstance(o, Request):
        return o.request_id
    return o


def _call(name: str, fn: Callable, sched: Scheduler, rng: random.Random):
    """Call part `name` on `sched` (a method of the scheduler or of its block manager) with args from `rng`."""
    part = PARTS[name]
    target = sched if part.component == "scheduler" else sched.bm
    bound = types.MethodType(fn, target)
    live = [r for r in sched.running if r.status is Status.RUNNING]
    if part.attr in ("schedule_continuous", "schedule_token_budget"):
        return bound()
    if part.attr == "make_room":
        if not live:
            return None
        req = live[rng.randrange(len(live))]
        return bound(req, req.num_computed_tokens + rng.randint(1, 3 * sched.bm.block_size), SchedulerOutput())
    if part.attr == "preempt":
        return bound(live[rng.randrange(len(live))]) if live else None
    if part.attr == "grow":
        if live and rng.random() < 0.7:
            req = live[rng.randrange(len(live))]
        else:
            req = Request("new", None, [1] * 8, SamplingParams(), 0.0)
        return bound(req, req.num_computed_tokens + rng.randint(0, 4 * sched.bm.block_size))
    if part.attr == "release":
        used = [b.block_id for b in sched.bm.blocks if b.ref_count > 0]
        shared = [b for b in used if sched.bm.blocks[b].ref_count > 1]  # the case reference counts exist for
        pick = shared if shared and rng.random() < 0.5 else used
        return bound(pick[rng.randrange(len(pick))]) if pick else None
    if part.attr == "recycle":
        # a block whose last reference just went: drop it by hand first, then let the part decide its fate
        used = [b for b in sched.bm.blocks if b.ref_count == 1]
        if not used:
            return None
        blk = used[rng.randrange(len(used))]
        blk.ref_count = 0
        return bound(blk.block_id)
    if part.attr == "evict":
        return bound() if sched.bm.evictable else None
    if part.attr == "match_prefix":
        waiting = list(sched.waiting) or [Request("q", None, [rng.randrange(100) for _ in range(20)],
                                                  SamplingParams(), 0.0)]
        return bound(waiting[rng.randrange(len(waiting))])
    if part.attr == "commit_full_blocks":
        if not live:
            return None
        req = live[rng.randrange(len(live))]
        if req.num_computed_tokens < req.num_tokens and rng.random() < 0.5:
            req.num_computed_tokens += 1  # a token just computed: its block may have become full
        return bound(req)
    if part.attr == "hash_block":
        parent = rng.choice([None, rng.randrange(1 << 30)])
        return bound(parent, tuple(rng.randrange(100) for _ in range(sched.bm.block_size)))
    raise KeyError(name)


def _diagnose(name: str, ref_out, you_out, ref: dict, you: dict) -> str:
    """Name the mistake where its pattern is recognisable."""
    if name.endswith("schedule_continuous") or name.endswith("schedule_token_budget"):
        rs, ys = ref_out["scheduled"], you_out["scheduled"]
        if len(you["running"]) > len(ref["running"]) and name.endswith("continuous"):
            return "you admitted more requests than the reference: check max_num_seqs, the budget and can_start"
        if name.endswith("continuous") and any(n == 1 for _, n in ys) and any(n > 1 for _, n in ys):
            return "a prefill-first step is either prompts or decodes, never both"
        if [r for r, _ in ys] and [r for r, _ in rs] and set(r for r, _ in ys) == set(r for r, _ in rs):
            return "the same requests, in another order (or with other token counts): keep first come, first served"
        if ref["waiting"] and you["waiting"] and ref["waiting"][0] != you["waiting"][0]:
            return "the head of the queue changed: a request that does not fit must block those behind it (FCFS)"
    if name.endswith("grow"):
        if ref_out is False and (you_out is not False or you != ref):
            return "when the pool cannot cover num_tokens, return False and change nothing"
        if you["free blocks (free_ids)"] != ref["free blocks (free_ids)"]:
            return "take exactly the missing blocks, each with self.take_block()"
    if name.endswith("release") or name.endswith("recycle"):
        return "a block is reused only when its last reference is gone (ref_count reaches 0)"
    if name.endswith("make_room") or name.endswith("preempt"):
        return "the victim is the newest running request (self.running[-1]), preempted with self.preempt"
    if name.endswith("evict"):
        return "evict the least recently used cached block (the front of self.evictable) and forget its hash"
    if name.endswith("commit_full_blocks"):
        return ("name only full blocks whose tokens are computed (num_computed_tokens // block_size), with the "
                "chained hash (self.hash_block(parent, ids)); never rename a block that already has a name")
    if name.endswith("match_prefix"):
        return "walk the prompt's full blocks in order, chaining hashes, stop at the first miss, leave >= 1 token"
    return ""


def check_part(name: str, fn: Callable, trials: int = 150, seed: int = 0) -> int:
    """Compare `fn` with the reference part `name` on `trials` random states. Returns the number of cases."""
    check_signature(name, fn)
    part = PARTS[name]
    ref_owner = Scheduler if part.component == "scheduler" else BlockManager
    if part.component == "attention":
        return _check_slot_mapping(fn, trials, seed)
    if part.component == "engine":
        return _check_stop_reason(fn, trials, seed)
    reference = getattr(ref_owner, part.attr)
    cases = 0
    for trial in range(trials):
        state = random_state(seed * 100_000 + trial, name)
        a, b = copy.deepcopy(state), copy.deepcopy(state)
        ref_out = _out(_call(name, reference, a, random.Random(trial)))
        try:
            raw = _call(name, fn, b, random.Random(trial))
            if part.attr.startswith("schedule_"):
                if not isinstance(raw, SchedulerOutput):
                    raise LearnerPartError(f"return the step as a SchedulerOutput, not {type(raw).__name__}")
                stale = [r.request_id for r in b.running if r.status.done]
                if stale:
                    raise LearnerPartError(f"requests {stale} had ended but are still in self.running after your "
                                           f"step: retire finished requests (status.done) first, they hold batch slots")
                b._check(raw, part.attr)
                b.running = [r for r in b.running if not r.status.done]
            you_out = _out(raw)
        except NotImplementedError:
            raise
        except LearnerPartError as err:
            raise AssertionError(f"{name}, case {trial}: {err}\nthe state before the call: {snapshot(state)}") from None
        except Exception as err:
            raise AssertionError(f"{name}, case {trial}: your function raised {type(err).__name__}: {err}\n"
                                 f"the state before the call: {snapshot(state)}") from err
        ref_s, you_s = snapshot(a), snapshot(b)
        if you_out != ref_out or you_s != ref_s:
            if you_out != ref_out:
                what = f"it returned {you_out!r}; expected {ref_out!r}"
            else:
                key = next(k for k in ref_s if ref_s[k] != you_s[k])
                what = f"afterwards {key} is {you_s[key]!r}; expected {ref_s[key]!r}"
            hint = _diagnose(name, ref_out, you_out, ref_s, you_s)
            raise AssertionError(f"{name}, case {trial}: {what}" + (f"\nlikely mistake: {hint}" if hint else "")
                                 + f"\nthe state before the call: {snapshot(state)}")
        cases += 1
    print(f"{name}: {cases} random cases agree with the reference")
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
                f"engine.stop_reason, case {trial}: returned {got!r}, expected {want!r} for token {token} "
                f"(eos_ids={sorted(eos)}, ignore_eos={params.ignore_eos}, stop_token_ids={params.stop_token_ids}, "
                f"{req.num_output_tokens} of max_tokens={params.max_tokens} output tokens, {req.num_tokens} tokens "
                f"of max_model_len={max_model_len})\nlikely mistake: {hint}")
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
                raise AssertionError(f"attention.slot_mapping, case {trial}: {len(got)} slots for {len(want)} new "
                                     f"tokens (query_lens={q}): one slot per token the step computes")
            i = next(k for k in range(len(want)) if got[k] != want[k])
            raise AssertionError(
                f"attention.slot_mapping, case {trial}: slot {i} is {got[i]}, expected {want[i]} "
                f"(block_size={bs}, block_tables={tables}, context_lens={ctx}, query_lens={q}); a sequence's new "
                f"tokens are its last query_len positions, and position p is at offset p % block_size of block "
                f"table[p // block_size]")
    print(f"attention.slot_mapping: {trials} random cases agree with the reference")
    return trials


# -- the real engine with the learner's parts -----------------------------------------------------------
def check_in_engine(parts: EngineParts, lab: str, num_requests: int = 24, seed: int = 0) -> dict:
    """The engine as of `lab`, on a tiny random model: reference parts vs `parts`, same random workload.
    Every request finishes, greedy tokens are equal, every block comes back. Returns what it measured."""
    from lab_utils.engine.engine import LLMEngine
    from lab_utils.learner import engine_config
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
        results[who] = ([o.token_ids for o in outs], engine.stats())
    ref_tokens, ref_stats = results["reference"]
    you_tokens, you_stats = results["yours"]
    bad = [i for i, (a, b) in enumerate(zip(ref_tokens, you_tokens)) if a != b]
    assert not bad, (f"with your parts the engine generated different tokens for {len(bad)} of {num_requests} "
                     f"requests (first: request {bad[0]}: {you_tokens[bad[0]][:8]}... vs the reference's "
                     f"{ref_tokens[bad[0]][:8]}...)")
    for key, what in (("num_steps", "engine steps"), ("num_preemptions", "preemptions"),
                      ("prefix_cache_hit_rate", "prefix-cache hit rate")):
        assert you_stats[key] == ref_stats[key], (
            f"with your parts the engine took other decisions than the reference's on the same requests: "
            f"{what} {you_stats[key]} vs {ref_stats[key]}")
    summary = {"requests": num_requests, "finished": num_requests, "tokens_equal": True, "blocks_leaked": 0,
               "preemptions": you_stats["num_preemptions"], "steps": you_stats["num_steps"],
               "reference_steps": ref_stats["num_steps"], "prefix_cache_hit_rate": you_stats["prefix_cache_hit_rate"]}
    print(f"the real engine (lab {lab} configuration, tiny model) ran your parts: {num_requests} requests finished, "
          f"tokens equal to the reference's, 0 blocks leaked, {summary['preemptions']} preemptions, "
          f"{summary['steps']} steps (reference: {summary['reference_steps']})")
    return summary
