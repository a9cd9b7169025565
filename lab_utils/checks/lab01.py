"""Lab 01: the continuous-batching admit/retire step, on a toy queue, plus the toy simulator the lab uses.

A toy request only knows how many decode steps it still needs (`remaining`; 0 = done). One scheduling step
takes (running, waiting, max_num_seqs) and returns (running, waiting, finished):
- continuous: finished requests leave, then waiting ones join (first come, first served) until the batch
  holds `max_num_seqs`;
- static: finished requests stop working (their slots idle, computed as padding in a real batch), but nobody
  joins until the whole batch has left.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from lab_utils.checks.claims import Claim


@dataclass(frozen=True)
class ToyRequest:
    id: str
    remaining: int  # decode steps still to run; 0 = finished

    def step(self) -> "ToyRequest":
        return ToyRequest(self.id, self.remaining - 1)


StepFn = Callable[[list, list, int], tuple]


def reference_admit_retire(running: list[ToyRequest], waiting: list[ToyRequest], max_num_seqs: int):
    still = [r for r in running if r.remaining > 0]
    free = max_num_seqs - len(still)
    return still + waiting[:free], waiting[free:], [r for r in running if r.remaining == 0]


def static_admit_retire(running: list[ToyRequest], waiting: list[ToyRequest], max_num_seqs: int):
    """Static batching: the next batch is admitted only once every member of the current one has finished."""
    still = [r for r in running if r.remaining > 0]
    finished = [r for r in running if r.remaining == 0]
    if still:
        return still, list(waiting), finished
    return waiting[:max_num_seqs], waiting[max_num_seqs:], finished


@dataclass
class ToyRun:
    steps: int
    batch: list[list[str]] = field(default_factory=list)  # ids running in each step
    finish_step: dict[str, int] = field(default_factory=dict)

    @property
    def slot_steps_used(self) -> int:
        return sum(len(b) for b in self.batch)

    def utilization(self, max_num_seqs: int) -> float:
        """Share of the batch's slot-steps that did useful work."""
        return self.slot_steps_used / (self.steps * max_num_seqs) if self.steps else 0.0


def simulate(step_fn: StepFn, output_lens: list[int], max_num_seqs: int, max_steps: int = 1_000_000) -> ToyRun:
    """Run a burst of requests (all waiting at step 0, each needing `output_lens[i]` steps) to completion."""
    running: list[ToyRequest] = []
    waiting = [ToyRequest(str(i), n) for i, n in enumerate(output_lens)]
    run = ToyRun(0)
    while running or waiting:
        running, waiting, finished = (list(x) for x in step_fn(list(running), list(waiting), max_num_seqs))
        for r in finished:
            run.finish_step[r.id] = run.steps
        if not running:
            if waiting:
                raise AssertionError(f"nothing is running but {len(waiting)} requests wait: the step admitted nobody")
            break
        run.batch.append([r.id for r in running])
        running = [r.step() for r in running]
        run.steps += 1
        if run.steps > max_steps:
            raise AssertionError(f"no end after {max_steps} steps: are finished requests ever retired?")
    return run


# --------------------------------------------------------------------------------------------- the check
def _ids(xs) -> list[str]:
    return [f"{r.id}({r.remaining})" for r in xs]


def _random_case(rng: random.Random):
    B = rng.randint(1, 6)
    n_run = rng.randint(0, B)
    running = [ToyRequest(f"r{i}", rng.choice([0, 0, 1, 2, 5])) for i in range(n_run)]
    waiting = [ToyRequest(f"w{i}", rng.randint(1, 9)) for i in range(rng.randint(0, 7))]
    return running, waiting, B


_EDGE_CASES = [
    ([], [ToyRequest("w0", 3), ToyRequest("w1", 1), ToyRequest("w2", 2)], 2),  # empty batch fills up
    ([ToyRequest("r0", 0), ToyRequest("r1", 4)], [ToyRequest("w0", 2), ToyRequest("w1", 5)], 2),  # one leaves, one joins
    ([ToyRequest("r0", 0), ToyRequest("r1", 0)], [], 3),  # everyone finishes, nobody waits
    ([ToyRequest("r0", 3), ToyRequest("r1", 4)], [ToyRequest("w0", 2)], 2),  # full: nobody joins
    ([ToyRequest("r0", 1), ToyRequest("r1", 0), ToyRequest("r2", 2)], [ToyRequest(f"w{i}", i + 1) for i in range(4)], 4),
]


def _diagnose(running, waiting, B, got_run, got_fin) -> str:
    still = [r for r in running if r.remaining > 0]
    if any(r.remaining == 0 for r in got_run):
        return "a finished request (remaining == 0) is still in the batch: retire finished requests first"
    if len(got_run) > B:
        return f"the batch holds {len(got_run)} requests but max_num_seqs is {B}"
    wrong_count = [r for r in running if r.remaining == 0 and r not in got_fin]
    if wrong_count:
        return f"finished requests {_ids(wrong_count)} were not returned in `finished`"
    if len(got_run) < min(B, len(still) + len(waiting)):
        ahead = still + waiting[:max(B - len(running), 0)]
        if [r.id for r in got_run] == [r.id for r in ahead]:
            return ("free slots were counted before retiring: a slot freed this step must be refilled this step "
                    "(that is the whole point of continuous batching)")
        if not still and len(got_run) == 0:
            return "nobody was admitted into an empty batch"
        return "there were free slots and waiting requests, but not every free slot was filled"
    joined = [r for r in got_run if r not in running]
    if [r.id for r in joined] != [r.id for r in waiting[:len(joined)]]:
        return "requests must join in arrival order (first come, first served): take them from the front of `waiting`"
    if [r.id for r in got_run if r in running] != [r.id for r in still]:
        return "keep the running requests in their order, with newcomers after them"
    return ""


def check_admit_retire(fn: StepFn, seed: int | None = None, cases: int = 200) -> None:
    """Compare `fn(running, waiting, max_num_seqs)` with the reference on edge cases and random toy queues, then
    run a whole workload through it. Raises AssertionError saying what differs."""
    rng = random.Random(seed)
    all_cases = list(_EDGE_CASES) + [_random_case(rng) for _ in range(cases)]
    for k, (running, waiting, B) in enumerate(all_cases):
        want = reference_admit_retire(list(running), list(waiting), B)
        got = fn(list(running), list(waiting), B)  # copies: the learner may mutate them
        if not isinstance(got, tuple) or len(got) != 3:
            raise AssertionError(f"return a tuple (running, waiting, finished), got {type(got).__name__}"
                                 + (f" of length {len(got)}" if isinstance(got, tuple) else ""))
        got_run, got_wait, got_fin = (list(x) for x in got)
        if (got_run, got_wait, sorted(got_fin, key=lambda r: r.id)) == (
                want[0], want[1], sorted(want[2], key=lambda r: r.id)):
            continue
        before = set(r.id for r in running) | set(r.id for r in waiting)
        after = [r.id for r in got_run + got_wait + got_fin]
        lost, dup = before - set(after), sorted({i for i in after if after.count(i) > 1})
        why = _diagnose(running, waiting, B, got_run, got_fin)
        if why:
            pass
        elif lost:
            why = f"requests {sorted(lost)} disappeared (every request must end in running, waiting or finished)"
        elif dup:
            why = f"requests {dup} appear twice"
        elif got_wait != want[1]:
            why = "`waiting` should keep exactly the requests that did not fit, in their order"
        raise AssertionError(
            f"case {k}: max_num_seqs={B}, running={_ids(running)}, waiting={_ids(waiting)}\n"
            f"  expected running={_ids(want[0])}, waiting={_ids(want[1])}, finished={_ids(want[2])}\n"
            f"  got      running={_ids(got_run)}, waiting={_ids(got_wait)}, finished={_ids(got_fin)}\n"
            f"  {why or 'the result differs from continuous batching'}")
    lens = [rng.randint(1, 30) for _ in range(25)]
    want_run, got_run = simulate(reference_admit_retire, lens, 4), simulate(fn, lens, 4)
    if got_run.steps != want_run.steps:
        raise AssertionError(f"a whole burst of {len(lens)} requests took {got_run.steps} steps with your step, "
                             f"{want_run.steps} with continuous batching")
    print(f"check_admit_retire passed: {len(all_cases)} queues and a {len(lens)}-request run match continuous batching")


# -- the engine part (lab 01's exercise) -------------------------------------------------------------------
def check_schedule_continuous(fn, cases: int = 200) -> None:
    """Your `schedule_continuous(self)` against the engine's on random scheduler states; then it becomes the
    engine's scheduling step (saved to my_engine/scheduler.py)."""
    from lab_utils.course import learner_parts
    from lab_utils.checks.parts_check import check_part

    check_part("scheduler.schedule_continuous", fn, trials=cases)
    learner_parts.submit("scheduler.schedule_continuous", fn)


# -- the lab's claims ----------------------------------------------------------------------------------------
RERUN = ("close what keeps the CPU busy and rerun the serving cell of section 3 (static and continuous, "
         "interleaved), then the cells after it")
CONTINUOUS_RUN_PARTS = ("scheduler.schedule_continuous", "engine.stop_reason")


def claims(r: dict) -> list[Claim]:
    """Lab 01's claims from the run's measurements `r` (built in the notebook's claims cell).

    `throughput_rounds`: continuous / static output throughput of each round of the interleaved runs (static,
    continuous, static, ...); the throughput claim is judged on them (`lab_utils.checks.timing`), so a load that
    comes and goes cannot fail it falsely: rounds that disagree across the bar give NOT JUDGED. `static_steps`,
    `continuous_steps`: engine steps of one run (the same every round). `mismatch`: the request ids, per run,
    whose batched tokens differ from one-at-a-time generation beyond a near-tie; `static_eq_cont`: both policies
    agree on every request. `calls`: how often the continuous runs called each of your parts. `step_logs`: the
    step logs of one static and one continuous run ({"static": [...], "continuous": [...]}): the throughput claim is
    judged where this device's step costs, fitted on them, predict >= 2x (a step's cost grows with its rows, as on a
    CPU); where a step costs about the same whatever its rows (a launch-bound GPU) it is NOT JUDGED, saying so."""
    from lab_utils.checks.claims import need, parts_called
    from lab_utils.checks.timing import StepCosts, device_condition, judge

    need(r, "throughput_rounds", "static_steps", "continuous_steps", "mismatch", "static_eq_cont", "calls", "step_logs")
    steps_s, steps_c = r["static_steps"], r["continuous_steps"]
    differing = {name: ids for name, ids in r["mismatch"].items() if ids}
    logs = r["step_logs"]
    costs = StepCosts.fit([logs["static"], logs["continuous"]])
    predicted = costs.run_seconds(logs["static"]) / costs.run_seconds(logs["continuous"])
    return [
        device_condition(
            judge("continuous batching gives >= 2x the output throughput of static batching on this workload",
                  r["throughput_rounds"], 2.0, RERUN),
            predicted, 2.0, costs, "steps whose cost grows with their rows (static batching pays for its padding "
            "rows); here continuous batching gains through its fewer steps, judged below"),
        (f"continuous batching needs fewer engine steps than static ({steps_c} vs {steps_s}, "
         f"{steps_s / max(steps_c, 1):.2f}x fewer)", 0 < steps_c < steps_s),
        ("batched greedy output is identical to one-at-a-time generation (or parts only at near-ties)"
         + (f"; differs for {differing}" if differing else ""), not differing),
        ("static and continuous batching produce the same tokens", bool(r["static_eq_cont"])),
        parts_called("the continuous runs", r["calls"], CONTINUOUS_RUN_PARTS),
    ]


def assert_claims(r: dict, show: bool = True) -> None:
    """Print lab 01's claims; AssertionError naming each one that fails (a NOT JUDGED claim raises nothing)."""
    from lab_utils.checks.claims import report

    report(claims(r), show)


def check_stop_reason(fn, cases: int = 300) -> None:
    """Your `stop_reason` against the engine's on random requests and tokens; then the engine uses it."""
    from lab_utils.course import learner_parts
    from lab_utils.checks.parts_check import check_part

    check_part("engine.stop_reason", fn, trials=cases)
    learner_parts.submit("engine.stop_reason", fn)


# every check_* above also records its result in the learner's own log (lab_utils.workshop.records)
from lab_utils.workshop.records import record_checks  # noqa: E402

record_checks(globals())
