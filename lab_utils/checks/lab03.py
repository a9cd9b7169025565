"""Checks for lab 03's exercise: the engine's token-budget step, `Scheduler.schedule_token_budget` (vLLM V1).

`check_schedule_token_budget(fn)` is `parts_check.check_part`: first a few small hand-built steps
(`part_cases.token_budget_steps`), in each of which one known mistake shows (admitting new prompts before the
running requests, not chunking the last prompt, keeping finished requests in the batch, stopping a running prompt's
chunks, admitting after a preemption) and is named by `parts_check`'s diagnosers; then `fn` against the reference on
random engine states in every setting the engine runs it in (prefix caching on and off, both preemption modes).
When both pass, the function becomes the engine's part (`learner_parts.submit`), so the lab's measurements run it.
The reference is never shown.
"""
from __future__ import annotations

from collections.abc import Callable

from lab_utils.checks import parts_check
from lab_utils.checks.claims import Claim

PART = "scheduler.schedule_token_budget"


def check_schedule_token_budget(fn: Callable, trials: int = 150, seed: int = 0, submit: bool = True) -> None:
    """Hand-built steps with named mistakes, then random engine states against the reference; on success (and
    with `submit`) the function becomes the engine's `schedule_token_budget` (saved to my_engine/scheduler.py)."""
    from lab_utils.course import learner_parts

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
