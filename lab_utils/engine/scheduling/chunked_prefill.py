"""Chunked prefill (lab 03): a prompt longer than what is left of the step's token budget runs in chunks, one
per step, instead of holding the step (and every decode waiting behind it) for its whole length.

- `continue_prefills`: a running request whose prompt is not yet computed gets its next chunk (the static and
  continuous policies call it first; a recomputed request after preemption is one too).
- `schedule_token_budget`: vLLM V1's step. Each step first gives every running request its next token(s),
  oldest first (decodes, and the next chunk of a prompt still being prefilled), then fills the rest of
  `max_num_batched_tokens` with (chunks of) waiting prompts, in one mixed batch.
A waiting prompt is cut to the budget when it is admitted (`Scheduler._admit`, with `enable_chunked_prefill`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from lab_utils.engine.request import Status
from lab_utils.engine.scheduling.output import SchedulerOutput

if TYPE_CHECKING:
    from lab_utils.engine.scheduler import Scheduler


def continue_prefills(self: Scheduler, out: SchedulerOutput, budget: int) -> int:
    """Running requests whose prompt is not yet computed (chunked prefill, or a recompute) get their next chunk."""
    for req in list(self.running):
        remaining = req.num_tokens - req.num_computed_tokens
        if budget <= 0 or req.status is not Status.RUNNING or (remaining == 1 and not req.is_prefill):
            continue
        n = min(remaining, budget)
        if self.make_room(req, req.num_computed_tokens + n, out):
            out.scheduled.append((req, n))
            budget -= n
    return budget


def schedule_token_budget(self: Scheduler) -> SchedulerOutput:
    """vLLM V1's unified token budget with chunked prefill: running requests first, oldest first (a decode
    takes 1 token, an unfinished prompt its next chunk), then new prompts fill what is left of the budget."""
    out = SchedulerOutput()
    self.running = [r for r in self.running if not r.status.done]
    budget = self.config.max_num_batched_tokens
    for req in list(self.running):
        if budget <= 0:
            break
        if req.status is not Status.RUNNING:
            continue  # preempted earlier in this loop
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if self.make_room(req, req.num_computed_tokens + n, out):
            out.scheduled.append((req, n))
            budget -= n
    # speculative decoding (lab 07): keep room in the step for each decode's guesses
    budget -= self.lookahead * sum(1 for r, n in out.scheduled if n == 1 and not r.is_prefill)
    if not out.preempted:  # memory is short: no newcomer this step
        self._admit(out, budget)
    return out
