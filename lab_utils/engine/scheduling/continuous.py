"""Continuous batching (Orca, lab 01): finished requests leave and waiting ones join at every step.

Prefill-first, as in nano-vllm: a step is either all prefill (whole prompts, or with chunked prefill the next
chunk of each) or all decode.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from lab_utils.engine.scheduling.output import SchedulerOutput

if TYPE_CHECKING:
    from lab_utils.engine.scheduler import Scheduler


def schedule_continuous(self: Scheduler) -> SchedulerOutput:
    """Continuous batching, prefill-first: retire the finished, admit waiting prompts first come first served
    while a slot, the step's token budget and the KV pool allow; a step that runs no prompt decodes every
    running request. (With chunked prefill a long prompt runs in chunks of the budget, one per step.)"""
    out = SchedulerOutput()
    self.running = [r for r in self.running if not r.status.done]  # retire: finished requests leave
    budget = self._continue_prefills(out, self.config.max_num_batched_tokens)
    self._admit(out, budget)
    if not out.scheduled:
        self._decode_all(out)
    return out
