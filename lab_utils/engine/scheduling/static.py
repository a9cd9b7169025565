"""Static batching, the baseline: a batch is admitted together and nobody joins until all of it has finished.

A finished member stays in the batch as a padding row until the whole batch ends: every decode step runs at the
batch's full size (`SchedulerOutput.num_padding` rows whose outputs are thrown away). That is what static
batching costs in the papers' baseline (Orca's FasterTransformer) and in Hugging Face `generate` with padding:
the batch is one tensor, and a finished row keeps computing until the longest row stops.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from lab_utils.engine.scheduling.output import SchedulerOutput

if TYPE_CHECKING:
    from lab_utils.engine.scheduler import Scheduler


def schedule_static(self: Scheduler) -> SchedulerOutput:
    """Static batching: a batch is admitted together and nobody joins until all of it has finished."""
    out = SchedulerOutput()
    self.running = [r for r in self.running if not r.status.done]
    if not self.running and self.static_quota == 0:
        self.static_quota = self.static_batch_size = min(len(self.waiting), self.config.max_num_seqs)
    budget = self._continue_prefills(out, self.config.max_num_batched_tokens)
    if self.static_quota > 0:
        admitted = len(out.scheduled)
        self._admit(out, budget, limit=self.static_quota)
        self.static_quota -= len(out.scheduled) - admitted
    if not out.scheduled:
        self.static_quota = 0  # the batch could not grow further: it is closed
        self._decode_all(out)
        out.num_padding = max(0, self.static_batch_size - len(out.scheduled))
    return out
