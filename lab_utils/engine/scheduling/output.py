"""What every scheduling policy returns for one step."""
from __future__ import annotations

from dataclasses import dataclass, field

from lab_utils.engine.request import Request


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_padding: int = 0  # static batching: rows of finished members still computed (outputs discarded)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)
