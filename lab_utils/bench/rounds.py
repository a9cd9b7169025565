"""Measuring two or more setups in rounds, interleaved (A, B, A, B, ...), so that load which comes and goes on the
machine hits every setup alike. The labs' timing claims (`lab_utils.checks.timing`) and the efficiency
measurements (`lab_utils.efficiency`) both measure this way.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def interleave(runs: Mapping[K, Callable[[], T]], rounds: int,
               progress: Callable[[range], object] | None = None) -> dict[K, list[T]]:
    """Run each of `runs` once per round, in order (A, B, A, B, ...); {name: [result of each round]}."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    out: dict[K, list[T]] = {name: [] for name in runs}
    for _ in (progress or (lambda r: r))(range(rounds)):
        for name, fn in runs.items():
            out[name].append(fn())
    return out
