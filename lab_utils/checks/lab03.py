"""Checks for lab 03's exercise: the engine's token-budget step, `Scheduler.schedule_token_budget` (vLLM V1).

`check_schedule_token_budget(fn)` first runs a few small hand-built steps, in each of which one known mistake
shows (admitting new prompts before the running requests, not chunking the last prompt, keeping finished
requests in the batch, stopping a running prompt's chunks, admitting after a preemption) and is named by
`parts_check`'s diagnosers; then `parts_check.check_part` compares `fn` with the reference on random engine
states in every setting the engine runs it in (prefix caching on and off, both preemption modes). When both pass, the function
becomes the engine's part (`learner_parts.submit`), so the lab's measurements run it. The reference is never shown.
"""
from __future__ import annotations

from typing import Callable

from lab_utils.checks import parts_check
from lab_utils.checks.claims import Claim
from lab_utils.engine.kv.block_manager import BlockManager
from lab_utils.engine.config import EngineConfig
from lab_utils.course.parts import check_signature
from lab_utils.engine.request import Request, Status
from lab_utils.engine.sampling_params import SamplingParams
from lab_utils.engine.scheduler import Scheduler

PART = "scheduler.schedule_token_budget"


def _scheduler(budget: int, num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    cfg = EngineConfig(scheduler="token_budget", block_size=4, max_num_batched_tokens=budget,
                       max_num_seqs=max_num_seqs, enable_chunked_prefill=True, enable_prefix_caching=False,
                       watermark=0.0)
    return Scheduler(cfg, BlockManager(num_blocks, 4, enable_prefix_caching=False, watermark=0.0))


def _req(rid: str, prompt_len: int) -> Request:
    return Request(rid, None, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=32, ignore_eos=True), 0.0)


def _step(sched: Scheduler) -> None:
    """One reference step and what the engine does after the model ran (count tokens, sample one)."""
    for req, n in sched.schedule().scheduled:
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.token_ids.append(7)


def _scenarios() -> list[tuple[str, Scheduler]]:
    """(what it is, the scheduler just before the step): small steps in which one known mistake shows."""
    out = []
    # two requests decoding, a long prompt arrives: decodes first, then the prompt chunked into what is left
    s = _scheduler(budget=8)
    s.add(_req("a", 5)), s.add(_req("b", 3))
    _step(s)
    s.add(_req("long", 20))
    out.append(("two decodes and a new 20-token prompt, budget 8", s))
    # a prompt half prefilled keeps priority over a new prompt
    s = _scheduler(budget=8)
    s.add(_req("a", 20))
    _step(s)
    s.add(_req("b", 4))
    out.append(("a 20-token prompt with 8 tokens computed, and a new 4-token prompt, budget 8", s))
    # a finished request must leave before anyone counts the slots
    s = _scheduler(budget=16, max_num_seqs=2)
    s.add(_req("a", 3)), s.add(_req("b", 3))
    _step(s)
    s.finish(s.running[1], Status.FINISHED)
    s.add(_req("c", 4))
    out.append(("max_num_seqs=2, one running request just finished, one new prompt", s))
    # memory short: the step preempts, and then nobody new may join
    s = _scheduler(budget=5, num_blocks=4)
    s.add(_req("a", 8)), s.add(_req("b", 4))
    for _ in range(3):
        _step(s)
    out.append(("a 4-block pool, two requests; the step must preempt the newest", s))
    return out


def _run_scenarios(fn: Callable) -> None:
    for what, sched in _scenarios():
        parts_check.compare_call(PART, fn, sched, lambda f, s, w=what: parts_check.Call(result=f(s), called=w),
                                 f"the step with {what}")


def check_schedule_token_budget(fn: Callable, trials: int = 150, seed: int = 0, submit: bool = True) -> None:
    """Hand-built steps with named mistakes, then random engine states against the reference; on success (and
    with `submit`) the function becomes the engine's `schedule_token_budget` (saved to my_engine/scheduler.py)."""
    from lab_utils.course import learner_parts

    check_signature(PART, fn)
    _run_scenarios(fn)
    parts_check.check_part(PART, fn, trials=trials, seed=seed)
    if submit:
        learner_parts.submit(PART, fn)


# --- the lab's closing claims --------------------------------------------------------------------------------
def claims(r: dict) -> list[Claim]:
    """Lab 03's claims from the sweep's measurements `r` (built in the notebook's claims cell); `calls`: how often
    the sweep's runs called each of your parts (`parts.calls` over the sweep)."""
    from lab_utils.checks.claims import need, parts_called

    need(r, "rows", "chunked_budgets", "runs_complete", "run_tokens", "whole_prompt_tokens", "calls")
    by = {(row["scheduler"], row["budget"]): row for row in r["rows"]}
    chunked = list(r["chunked_budgets"])
    worst = {b: by[("continuous", b)]["max_itl_ms"] / by[("token_budget", b)]["max_itl_ms"] for b in chunked}
    complete, runs = list(r["runs_complete"]), list(r["run_tokens"])
    whole = r["whole_prompt_tokens"]
    model, prompts = r.get("model"), r.get("prompts")  # given: a parting at a near-tie is not a difference

    def unchanged(run: dict) -> bool:
        if run == whole:
            return True
        if model is None or set(run) != set(whole):
            return False
        from lab_utils.checks.teacher_forced import compare_greedy_runs

        return compare_greedy_runs(model, prompts, run, whole).ok

    same = [unchanged(t) for t in runs]
    exact = sum(t == whole for t in runs)
    return [
        (f"token budget shortens the worst stall (max ITL) vs prefill-first at every budget that chunks the long "
         f"prompts ({', '.join(f'{b}: {worst[b]:.1f}x' for b in chunked)})",
         bool(chunked) and all(w > 1 for w in worst.values())),
        (f"every request finished, with the tokens it asked for, in all {len(complete)} runs of the sweep",
         bool(complete) and all(complete)),
        (f"chunked prefill leaves greedy outputs unchanged: all {len(runs)} chunked runs (both policies, every "
         f"budget) generated the same tokens as whole-prompt prefill ({exact} identical, the rest parting first at a "
         f"near-tie of the model's dtype)", bool(runs) and all(same)),
        parts_called("the token-budget runs of the sweep", r["calls"], [PART]),
    ]


def assert_claims(r: dict, show: bool = True) -> None:
    """Print lab 03's claims; AssertionError naming each one that fails."""
    from lab_utils.checks.claims import report

    report(claims(r), show)


# every check_* above also records its result in the learner's own log (lab_utils.workshop.records)
from lab_utils.workshop.records import record_checks  # noqa: E402

record_checks(globals())
