"""The engine's one seam for replacing a part: the `parts=` argument of `LLMEngine`.

Some methods of the engine's core classes (the scheduler's policies, the block manager's allocator and prefix
cache) and some functions (the stop rule, the slot mapping, the quantizers, the verify step) can be replaced by
another implementation with the same name and signature. The engine asks its `parts` object for each:

    parts.subclass(Scheduler, "scheduler")      # Scheduler itself, or a subclass with replaced methods
    parts.function("engine.stop_reason", ref)   # ref itself, or the replacement

`ReferenceParts` (the default) replaces nothing. The course's `lab_utils.course.parts.EngineParts` holds a
learner's parts, wraps each so an error inside names the part, and counts their calls.

`LearnerPartError` is what a replaced part's broken invariant raises (an AssertionError, like a failed check); the
engine's own invariant checks that only a replaced part can break raise it too, and only run when `parts`
replaces something.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Protocol


class LearnerPartError(AssertionError):
    """A part of the engine (usually a learner's) broke an invariant the engine relies on; the message says
    which one and how to fix it. An AssertionError, like every exercise check's failure."""


class Parts(Protocol):
    """What the engine asks of its `parts=`."""

    overrides: dict[str, Callable]  # part name -> the replacement (empty: the reference engine)

    def __bool__(self) -> bool: ...

    def subclass(self, base: type, component: str) -> type: ...

    def function(self, name: str, reference: Callable) -> Callable: ...

    def stall_error(self, engine, stuck) -> Exception | None: ...


class ReferenceParts:
    """Replaces nothing: the engine runs its own parts."""

    def __init__(self) -> None:
        self.overrides: dict[str, Callable] = {}
        self.origins: dict[str, str] = {}
        self.calls: Counter[str] = Counter()

    def __bool__(self) -> bool:
        return False

    def is_learners(self, name: str) -> bool:
        return False

    def subclass(self, base: type, component: str) -> type:
        return base

    def function(self, name: str, reference: Callable) -> Callable:
        return reference

    def stall_error(self, engine, stuck) -> Exception | None:
        return None

    def __repr__(self) -> str:
        return "ReferenceParts()"


REFERENCE = ReferenceParts()
