"""Timing claims that a busy laptop can still judge.

A timing claim compares two measurements (cached vs naive generation, a batch vs one at a time). Measured one
after the other, a browser or a video call that wakes up between them turns the comparison into noise. So the
labs measure both sides in rounds, interleaved (A, B, A, B, ...): whatever load comes and goes hits both sides
of a round alike, and each round gives one ratio. `judge` decides from those per-round ratios:

- every round clears the bar: the claim holds; no round does: it fails;
- the rounds straddle the bar and agree with each other (within `max_spread`): the median round decides;
- they straddle it and disagree by more: the machine was too busy to tell, and the verdict is None
  ("not judged"), with the spread in the text and how to rerun, rather than a false PASS or FAIL.

A round where both sides are zero (no request met an SLO in either setup) carries no information: it is
dropped, never read as "A is not higher than B".
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

MAX_SPREAD = 1.6  # rounds whose ratios differ by more than this factor (and straddle the bar) cannot decide


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


def ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Per-round num/den; inf where only den is 0; a round where both are 0 is dropped (it says nothing)."""
    if len(num) != len(den):
        raise ValueError(f"need one value of each side per round, got {len(num)} and {len(den)}")
    return [a / b if b else math.inf for a, b in zip(num, den) if a or b]


def verdict(rounds: Sequence[float], bar: float, strict: bool = False,
            max_spread: float = MAX_SPREAD) -> bool | None:
    """Whether the ratio clears `bar` (`>` if strict, else `>=`), from per-round ratios; None: not judged."""
    clears = (lambda x: x > bar) if strict else (lambda x: x >= bar)
    rs = [x for x in rounds if not math.isnan(x)]
    if not rs:
        return None
    if all(clears(x) for x in rs):
        return True
    if not any(clears(x) for x in rs):
        return False
    lo, hi = min(rs), max(rs)
    if lo <= 0 or hi / lo > max_spread:
        return None
    return clears(statistics.median(rs))


def spread_text(rounds: Sequence[float]) -> str:
    """'3.1x' for one round, '3.1x median of 3 rounds, 2.8x-3.4x' for several."""
    rs = sorted(x for x in rounds if not math.isnan(x))
    if not rs:
        return "no round measured anything"
    fmt = lambda x: "inf" if math.isinf(x) else f"{x:.2f}x"  # noqa: E731
    if len(rs) == 1:
        return fmt(rs[0])
    return f"{fmt(statistics.median(rs))} median of {len(rs)} rounds, {fmt(rs[0])}-{fmt(rs[-1])}"


def judge(text: str, rounds: Sequence[float], bar: float, rerun: str, strict: bool = False,
          max_spread: float = MAX_SPREAD) -> tuple[str, bool | None]:
    """A claim (text, verdict) from per-round ratios; a claim that cannot be judged says why and how to rerun."""
    ok = verdict(rounds, bar, strict, max_spread)
    text = f"{text} [{spread_text(rounds)}]"
    if ok is None:
        why = ("no round measured anything on either side" if not [x for x in rounds if not math.isnan(x)]
               else f"the rounds straddle the bar of {bar:g}x and disagree by more than {max_spread:g}x")
        text += f" -- NOT JUDGED: {why}, so this machine was too busy to tell; {rerun}"
    return text, ok


def judge_error(text: str, errors: Mapping[str, float], spreads: Mapping[str, float], bound: float,
                rerun: str) -> tuple[str, bool | None]:
    """A prediction checked against a measurement repeated in the same run: (text, verdict).

    `errors[name]` = |predicted - measured| / measured, `spreads[name]` = how far the measurement's own repeats
    lie apart, relative to their mean. An error within `bound` holds; an error beyond it fails, unless the
    repeats themselves disagree by more than `bound`: then the measurement cannot resolve the bound, and the
    verdict is None ("not judged") with the spread in the text and how to rerun."""
    per = {}
    for name, err in errors.items():
        spread = spreads.get(name, 0.0)
        per[name] = True if err <= bound else (None if spread > bound else False)
    ok = False if False in per.values() else None if None in per.values() else True
    if ok is None:
        wide = ", ".join(f"{n} {spreads[n]:.0%}" for n, v in per.items() if v is None)
        text += (f" -- NOT JUDGED: the measurement's own repeats lie further apart than the {bound:.0%} bound "
                 f"({wide}), so this machine was too busy to tell; {rerun}")
    return text, ok
