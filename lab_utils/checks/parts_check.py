"""Checks for the engine parts a learner writes (labs 01-04): random cases against the reference, then the
real engine with the learner's part in it.

- `check_part(name, fn)`: one table, `PART_CHECKS`, says per part how it is checked. A part that acts on the
  scheduler or its block pool has an argument generator (`part_calls`), the snapshot of what it may change
  (`part_states.snapshot`), its known mistakes (`part_mistakes.MISTAKES`) and, for a scheduling step, the
  engine's guard on what it returns. Its check builds many random engine states (`part_states.random_state`),
  runs the reference method and the learner's on identical copies, and compares what they return and every
  piece of state they touch, per-request metrics included. The states cycle through every setting the engine
  runs the part in (`part_states.settings`), so a part that only works with the switches of its own lab fails
  in that lab. A scheduling step also meets a hand-built full pool where making room preempts within the step
  (`part_states.full_decode_pool`: random states seldom do). A part that is a plain function (`stop_reason`, `slot_mapping`) has its own random cases.
- A failure names the part, the file it is saved to (`my_engine/<component>.py`), the lab that writes it, the
  setting and the first value that differs. A "likely mistake" line comes only from a diagnoser whose evidence
  is in that difference; no solution is shown.
- `check_in_engine(parts, lab)`: the real `LLMEngine` on a tiny random model, once with the reference parts and
  once with the learner's, on a random workload sized to make the parts work hard (a small KV pool forces
  preemption): every request must finish, the greedy tokens must be equal, and every KV block must come back.
  When not, each of the learner's parts is checked alone, and the message names the one that is wrong.
"""
from __future__ import annotations

import copy
import random
import types
from collections.abc import Callable
from dataclasses import dataclass

from lab_utils.checks import part_calls, part_cases
from lab_utils.checks.part_calls import Call, result_view
from lab_utils.checks.part_mistakes import MISTAKES, Diagnoser, Evidence, diagnose
from lab_utils.checks.part_states import first_difference, full_decode_pool, random_state, settings, snapshot
from lab_utils.course.parts import PARTS, EngineParts, LearnerPartError, check_signature
from lab_utils.engine.kv.block_manager import BlockManager
from lab_utils.engine.request import Request
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


def _stop_reason_cases(fn: Callable, trials: int, seed: int) -> int:
    """`stop_reason(req, token, eos_ids, max_model_len)` on random requests and tokens, against the engine's."""
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
            hint = _stop_reason_hint(req, token, eos, max_model_len, want, got)
            raise AssertionError(
                f"{where('engine.stop_reason')}, case {trial}: returned {got!r}, expected {want!r} for token {token} "
                f"(eos_ids={sorted(eos)}, ignore_eos={params.ignore_eos}, stop_token_ids={params.stop_token_ids}, "
                f"{req.num_output_tokens} of max_tokens={params.max_tokens} output tokens, {req.num_tokens} tokens "
                f"of max_model_len={max_model_len})\n  likely mistake: {hint}")
    print(f"engine.stop_reason: {trials} random cases agree with the reference")
    return trials


def _stop_reason_hint(req: Request, token: int, eos: set[int], max_model_len: int, want: str | None,
                      got: str | None) -> str:
    """The likely mistake behind one wrong `stop_reason` answer, from the case that shows it."""
    p = req.params
    if p.ignore_eos and token in eos and token not in p.stop_token_ids:
        return "an end token does not stop a request with ignore_eos=True"
    if token in p.stop_token_ids:
        return "a token in params.stop_token_ids stops the request ('stop')" + (
            ", with ignore_eos=True too: ignore_eos ignores the end token only" if p.ignore_eos
            else ", also on the last token the length allows: check the token first" if got == "length" else "")
    if want == "stop" and got == "length":
        return ("an end token stops the request with 'stop', also on the last token the length allows: check the "
                "token first")
    if want == "length" and got is None and req.num_output_tokens == p.max_tokens:
        return f"at max_tokens={p.max_tokens} output tokens the request is done: compare with >=, not >"
    if want == "length" and got is None and req.num_tokens == max_model_len:
        return f"a sequence of max_model_len={max_model_len} tokens is full: compare with >=, not >"
    if want == "length" or got == "length":
        return ("'length': max_tokens counts output tokens only (req.num_output_tokens), and the whole sequence may "
                "not exceed max_model_len")
    return "an end token stops the request with 'stop'"


def _slot_mapping_cases(fn: Callable, trials: int, seed: int) -> int:
    """`slot_mapping(block_tables, context_lens, query_lens, block_size)` on random block tables, against the
    engine's."""
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
                raise AssertionError(f"{where('attention.slot_mapping')}, case {trial}: {len(got)} slots for "
                                     f"{len(want)} new tokens (query_lens={q}): one slot per token the step computes")
            i = next(k for k in range(len(want)) if got[k] != want[k])
            raise AssertionError(
                f"{where('attention.slot_mapping')}, case {trial}: slot {i} is {got[i]}, expected {want[i]} "
                f"(block_size={bs}, block_tables={tables}, context_lens={ctx}, query_lens={q}); a sequence's new "
                f"tokens are its last query_len positions, and position p is at offset p % block_size of block "
                f"table[p // block_size]")
    print(f"attention.slot_mapping: {trials} random cases agree with the reference")
    return trials


def _step_accepted(sched: Scheduler, result: object, attr: str) -> None:
    """The engine's guard on a scheduling step's result (raises LearnerPartError as the engine would); then the
    ended requests leave `running`, as the engine's step does."""
    if not isinstance(result, SchedulerOutput):
        raise LearnerPartError(f"return the step as a SchedulerOutput, not {type(result).__name__}")
    stale = [r.request_id for r in sched.running if r.status.done]
    if stale:
        raise LearnerPartError(f"requests {stale} had ended but are still in self.running after your "
                               f"step: retire finished requests (status.done) first, they hold batch slots")
    sched._check(result, attr)
    sched.running = [r for r in sched.running if not r.status.done]


def _promote_cases(fn: Callable, trials: int, seed: int) -> int:
    """`promote(self, name, ids, hits)` (lab 14) on random pools with a host tier (`lab14.promote_cases`)."""
    from lab_utils.checks import lab14

    return lab14.promote_cases(fn, trials, seed)


# -- how each part is checked ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PartCheck:
    """How `check_part` checks one part. A part of the scheduler or its block pool: `args` draws one call's
    arguments from a random state (`part_calls`), `snapshot` is what the call may change, `diagnosers` are its
    known mistakes, `accept` the engine's guard on its result, `fixed` hand-built states (what it shows, a builder
    given the part's name) checked before the random ones; `hand_built` the lab's own cases (`part_cases`: each
    a state and the call on it) and `precheck(fn, where, seed)` a direct check of its result, both run first. A
    plain function: `cases` runs its own random cases, `(fn, trials, seed) -> number of cases`."""
    args: Callable[[Scheduler, random.Random], Call | None] | None = None
    snapshot: Callable[[Scheduler], dict] = snapshot
    diagnosers: tuple[Diagnoser, ...] = ()
    accept: Callable[[Scheduler, object, str], None] | None = None
    cases: Callable[[Callable, int, int], int] | None = None
    fixed: tuple[tuple[str, Callable[[str], Scheduler]], ...] = ()
    hand_built: Callable[[], list[part_cases.Case]] | None = None
    precheck: Callable[[Callable, str, int], None] | None = None


_PREEMPTING_STEP = (("a decode step in a full pool, where making room for the oldest request preempts the newest",
                     full_decode_pool),)


PART_CHECKS: dict[str, PartCheck] = {
    **{name: PartCheck(args=args, diagnosers=MISTAKES.get(name, ()), accept=accept,
                       fixed=_PREEMPTING_STEP if accept is _step_accepted else (), hand_built=hand_built,
                       precheck=precheck) for name, args, accept, hand_built, precheck in [
        ("scheduler.schedule_continuous", part_calls.step_args, _step_accepted, None, None),
        ("scheduler.schedule_token_budget", part_calls.step_args, _step_accepted, part_cases.token_budget_steps,
         None),
        ("scheduler.make_room", part_calls.make_room_args, None, None, None),
        ("scheduler.preempt", part_calls.preempt_args, None, None, None),
        ("block_manager.grow", part_calls.grow_args, None, None, None),
        ("block_manager.release", part_calls.release_args, None, None, None),
        ("block_manager.hash_block", part_calls.hash_block_args, None, None, part_cases.hash_block_precheck),
        ("block_manager.commit_full_blocks", part_calls.commit_full_blocks_args, None,
         part_cases.commit_full_blocks_cases, None),
        ("block_manager.match_prefix", part_calls.match_prefix_args, None, part_cases.match_prefix_cases, None),
        ("block_manager.recycle", part_calls.recycle_args, None, part_cases.recycle_cases, None),
        ("block_manager.evict", part_calls.evict_args, None, part_cases.evict_cases, None),
    ]},
    "engine.stop_reason": PartCheck(cases=_stop_reason_cases),
    "attention.slot_mapping": PartCheck(cases=_slot_mapping_cases),
    "block_manager.promote": PartCheck(cases=_promote_cases),
}


def invoke(name: str, fn: Callable, sched: Scheduler, rng: random.Random) -> Call:
    """Call part `name` (a method of the scheduler or of its block manager) on `sched`, with arguments its
    generator draws from `rng`; a skipped `Call` when the state holds nothing to call it on."""
    call = PART_CHECKS[name].args(sched, rng)
    if call is None:
        return Call(skipped=True)
    target = sched if PARTS[name].component == "scheduler" else sched.bm
    call.result = types.MethodType(fn, target)(*call.args)
    return call


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
    """Run `call(reference, s)` and `call(fn, s)` on copies of `state`. Raises an AssertionError (`failure`)
    naming the part, `what` (the case), the first difference and, where a diagnoser of the part has evidence, the
    likely mistake. Returns False when the case did not apply (nothing to call it on)."""
    part, check = PARTS[name], PART_CHECKS[name]
    reference = getattr(Scheduler if part.component == "scheduler" else BlockManager, part.attr)
    before = check.snapshot(state)
    a, b = copy.deepcopy(state), copy.deepcopy(state)
    ref_call = call(reference, a)
    if ref_call.skipped:
        return False
    error, you_call = None, Call()
    try:
        you_call = call(fn, b)
        if check.accept is not None:
            check.accept(b, you_call.result, part.attr)
    except NotImplementedError:
        raise
    except LearnerPartError as err:
        error = str(err)
    except Exception as err:
        mutated = isinstance(err, RuntimeError) and "mutated during iteration" in str(err)
        raise failure(f"{where(name)}, {what}: your function raised {type(err).__name__}: {err}\n"
                      f"  called: {ref_call.called}" + (
                          "\n  likely mistake: self.start(req, n) takes req off self.waiting (and preempt takes a "
                          "request off self.running) while your for loop walks that queue: loop with while "
                          "self.waiting and take self.waiting[0], or walk a copy (list(self.running))"
                          if mutated else ""), name) from err
    if error is None:
        ref_s, you_s = {**check.snapshot(a), **_extras(ref_call)}, {**check.snapshot(b), **_extras(you_call)}
        ref_out, you_out = result_view(ref_call.result), result_view(you_call.result)
        if you_out == ref_out and you_s == ref_s:
            return True
        if you_out != ref_out:
            wrong = f"it returned {you_out!r}; expected {ref_out!r}"
        else:
            key, y, r = first_difference(ref_s, you_s)
            wrong = f"afterwards {key} is {y}; expected {r}"
    else:
        ref_s, you_s = check.snapshot(a), check.snapshot(b)
        wrong = error
    d = diagnose(Evidence(before, ref_s, you_s, ref_call, you_call, a, b, error), check.diagnosers)
    raise failure(f"{where(name)}, {what}: {wrong}\n  called: {ref_call.called}"
                  + (f"\n  likely mistake: {d.text}" if d else ""), name, d.id if d else None)


def check_part(name: str, fn: Callable, trials: int = 150, seed: int = 0) -> int:
    """Compare `fn` with the reference part `name` on `trials` random cases (`PART_CHECKS[name]`): for a part of
    the scheduler or its block pool, random states cycling through every setting the engine runs it in
    (`settings`). Returns the number of cases."""
    check_signature(name, fn)
    check = PART_CHECKS[name]
    if check.precheck is not None:
        check.precheck(fn, where(name), seed)
    for what, state, call in (check.hand_built() if check.hand_built is not None else ()):
        compare_call(name, fn, state, call, what)
    if check.cases is not None:
        return check.cases(fn, trials, seed)
    cases, kinds = 0, settings(name)
    for what, build in check.fixed:
        cases += compare_call(name, fn, build(name), lambda f, s: invoke(name, f, s, random.Random(seed)), what)
    for trial in range(trials):
        setting = kinds[trial % len(kinds)]
        state = random_state(seed * 100_000 + trial, name, setting)
        cases += compare_call(name, fn, state, lambda f, s, t=trial: invoke(name, f, s, random.Random(t)),
                              f"case {trial} ({setting})")
    print(f"{name}: {cases} random cases agree with the reference, in {len(kinds)} settings (prefix caching off and "
          f"on{', recompute and swap preemption' if len({k.preemption for k in kinds}) > 1 else ''}"
          f"{', whole prompts and chunked prefill' if len({k.policy for k in kinds}) > 1 else ''})")
    return cases


# -- the real engine with the learner's parts -----------------------------------------------------------
def _lab_check(name: str) -> Callable[[Callable], None]:
    """How the lab that teaches part `name` checks it (its hand-built cases too: `PART_CHECKS`), without saving
    it."""
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
