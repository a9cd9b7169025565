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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

# the rounds themselves live with the measuring tools (the efficiency measurements use them too); the labs' checks
# import `interleave` from here
from lab_utils.bench.rounds import interleave  # noqa: F401

MAX_SPREAD = 1.6  # rounds whose ratios differ by more than this factor (and straddle the bar) cannot decide


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


# ------------------------------------------------------------------------------------------------ device costs
# A timing claim such as "continuous batching gives >= 2x" holds where a step's cost grows with its work, as on a
# CPU; on a GPU whose small steps are launch-bound a step costs about the same at 1 token or 256. So such a claim
# reads this device's step costs (fitted on the engine's own step log, in the same run), predicts the ratio they
# allow, and is judged only where that prediction clears its bar with a margin (`device_condition`); elsewhere it
# is NOT JUDGED, saying what the device's costs predict and why.

DEVICE_MARGIN = 1.15  # the predicted ratio must clear the bar by this factor for the claim to be judged


@dataclass(frozen=True)
class Line:
    """Seconds of a step as `fixed_s + per_token_s * tokens`, fitted by least squares (slope >= 0)."""

    fixed_s: float
    per_token_s: float

    @classmethod
    def fit(cls, pts: Sequence[tuple[int, float]]) -> Line:
        """Fit on (tokens, seconds) points; one size only: its mean, flat."""
        n = len(pts)
        mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        if sxx == 0:
            return cls(my, 0.0)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in pts) / sxx)
        fixed = my - slope * mx
        if fixed < 0:  # a step cannot cost less than nothing: a line through the origin
            return cls(0.0, sum(x * y for x, y in pts) / sum(x * x for x, _ in pts))
        return cls(fixed, slope)

    def cost(self, tokens: float) -> float:
        return self.fixed_s + self.per_token_s * tokens


def is_decode_only(step: Mapping) -> bool:
    """A step whose every request computed one token (no prompt token): a GPU may replay it as a CUDA graph,
    while a step with prompt tokens runs eagerly, at another cost."""
    return bool(step.get("requests")) and all(n == 1 for _, n in step["requests"])


@dataclass(frozen=True)
class StepCosts:
    """An engine step's cost on this device, fitted on the steps of one or more step logs (`LLMEngine.step_log`)
    by least squares, one line per step kind: steps with prompt tokens (`prompt`, seconds per token computed) and
    decode-only steps (`decode`, seconds per row, padding rows included), since a GPU runs the two differently
    (eager vs CUDA graphs). A kind the logs lack takes the other's line."""

    prompt: Line
    decode: Line
    num_steps: int
    max_tokens: int

    @classmethod
    def fit(cls, logs: Iterable[Sequence[Mapping]]) -> StepCosts:
        """Fit on the steps of `logs` (each step: `start`, `end`, `num_tokens`, `requests`, optional
        `num_padding`)."""
        steps = [s for log in logs for s in log]
        pts = {kind: [(s["num_tokens"] + s.get("num_padding", 0), s["end"] - s["start"]) for s in steps
                      if is_decode_only(s) == (kind == "decode")] for kind in ("prompt", "decode")}
        sizes = {x for kind in pts.values() for x, _ in kind}
        if len(steps) < 2 or len(sizes) < 2:
            raise ValueError(f"fitting step costs needs steps of at least two sizes, got {len(steps)} steps of "
                             f"{sorted(sizes)} tokens: pass the step logs of the measured runs")
        lines = {kind: Line.fit(p) for kind, p in pts.items() if p}
        return cls(lines.get("prompt", lines.get("decode")), lines.get("decode", lines.get("prompt")), len(steps),
                   max(sizes))

    def cost(self, tokens: float, decode_only: bool = False) -> float:
        """Predicted seconds of a step computing `tokens` tokens (rows, for a decode-only step)."""
        return (self.decode if decode_only else self.prompt).cost(tokens)

    def run_seconds(self, log: Sequence[Mapping]) -> float:
        """Predicted seconds of the steps of a step log, each at its kind's cost."""
        return sum(self.cost(s["num_tokens"] + s.get("num_padding", 0), is_decode_only(s)) for s in log)

    def describe(self) -> str:
        """'a step with prompt tokens costs 98.10 ms + 0.05 us per token, a decode-only one 5.20 ms + ... per row
        (fitted on 112 steps of up to 512 tokens)'."""
        p, d = self.prompt, self.decode
        return (f"a step with prompt tokens costs {p.fixed_s * 1e3:.2f} ms + {p.per_token_s * 1e6:.2f} us per token, "
                f"a decode-only step {d.fixed_s * 1e3:.2f} ms + {d.per_token_s * 1e6:.2f} us per row (fitted on "
                f"{self.num_steps} steps of up to {self.max_tokens} tokens)")


def device_condition(claim: tuple[str, bool | None], predicted: float, bar: float, costs: StepCosts,
                     needs: str) -> tuple[str, bool | None]:
    """`claim` as judged, where this device's step costs predict a ratio that clears `bar` with a margin; else
    NOT JUDGED (verdict None), with the prediction, the costs, and what the claim `needs` to show."""
    text, ok = claim
    if predicted >= bar * DEVICE_MARGIN:
        return claim
    return (f"{text} -- NOT JUDGED: on this device {costs.describe()}, which predicts only {predicted:.2f}x (judged "
            f"where the prediction is >= {bar * DEVICE_MARGIN:.2f}x): the claim needs {needs}", None)


STEP_FLOOR_ENV = "LAB_STEP_FLOOR_S"  # seconds: the launch-bound profile for a whole process (a notebook's kernel)


def install_step_floor(step_s: float) -> Callable[[], None]:
    """From now on every engine step's forward lasts at least `step_s` from the step's start (the engine sleeps
    the rest), so a step's cost is flat in its tokens, as on a GPU whose small steps are launch-bound. Returns the
    function that removes it."""
    import time

    from lab_utils.engine.engine import LLMEngine

    if not step_s > 0:
        raise ValueError(f"step_s={step_s} must be > 0 (seconds a step lasts at least)")
    forward = LLMEngine._forward

    def flat(self, batch) -> None:
        forward(self, batch)
        left = step_s - (time.perf_counter() - batch.start)
        if left > 0:
            time.sleep(left)

    LLMEngine._forward = flat

    def remove() -> None:
        LLMEngine._forward = forward

    return remove


@contextmanager
def launch_bound_steps(step_s: float) -> Iterator[None]:
    """Inside: the launch-bound step-cost profile (`install_step_floor`). Tests run a CPU under it beside its own
    profile to see that no timing claim prints a false PASS or FAIL on either."""
    remove = install_step_floor(step_s)
    try:
        yield
    finally:
        remove()


def step_floor_from_env() -> float | None:
    """With LAB_STEP_FLOOR_S set (e.g. 0.05), install that floor for the whole process, so a notebook runs under
    the launch-bound profile (`lab_utils.checks` calls this on import); the floor, or None where it is unset."""
    import os

    value = os.environ.get(STEP_FLOOR_ENV, "").strip()
    if not value:
        return None
    try:
        step_s = float(value)
    except ValueError:
        raise ValueError(f"{STEP_FLOOR_ENV}={value!r} is not a number of seconds: set it to e.g. 0.05, or unset it")
    install_step_floor(step_s)
    return step_s
