"""Routing between a small model and the target, and the cost/quality curve as the router's threshold moves.

Every request first goes to the small model, which answers by scoring the task's options (`tasks`); its
confidence is the probability it gives its own pick (a softmax over its option scores), known before the target
runs. A router keeps the request on the small model when that confidence is at least a threshold, else sends it
to the target. Moving the threshold from 0 (always small) past 1 (always target, where the small model is not
asked at all) traces a curve of cost against answers kept (the share of requests whose answer is the target's
own). Any mix of the two endpoints at random lies on the straight line between them (a little under it: the
small model's probe is paid for every request), so a signal is worth something only where its curve lies above
that line.

Cost is compute: 2 x parameters FLOPs a prompt token the engine computed (the same tokens for both models: they
share a tokenizer), in units of always-target's cost. Time: each model's measured run over every task, shared out
over the tasks by their prompt tokens (a prefill's time grows with its tokens), gives every setting's seconds; the
notebook runs one setting for real to check that figure.
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lab_utils.efficiency.tasks import Task
from lab_utils.engine.sampling_params import SamplingParams


@dataclass
class Scored:
    """One model's answers to the tasks: per task its option scores (summed log-probabilities of the option's
    tokens after the statement) and its pick; the prompt tokens the engine computed per task; the run's time."""
    scores: list[list[float]]
    picks: list[int]
    tokens: list[int]
    wall_s: float
    params: int

    @property
    def flops(self) -> list[float]:
        return [2.0 * self.params * n for n in self.tokens]

    @property
    def seconds(self) -> list[float]:
        """Each task's share of the run's measured wall time, by its share of the prompt tokens computed."""
        total = sum(self.tokens)
        return [self.wall_s * n / total if total else 0.0 for n in self.tokens]


def score_options(engine, tokenizer, tasks: Sequence[Task]) -> Scored:
    """Each task's options scored by `engine`'s model in one batch (a request per option, asking for its prompt's
    log-probabilities); the pick is the option with the highest score."""
    prompts, spans = [], []
    for task in tasks:
        head = tokenizer(task.prompt, add_special_tokens=False).input_ids
        for option in task.options:
            tail = tokenizer(" " + option, add_special_tokens=False).input_ids
            prompts.append(head + tail)
            spans.append((len(head), len(head) + len(tail)))
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    wall = time.perf_counter() - t0
    flat = [sum(o.prompt_logprobs[i].logprob for i in range(a, b)) for o, (a, b) in zip(outs, spans)]
    computed = [len(o.prompt_token_ids) - o.num_cached_tokens for o in outs]
    scores, tokens, k = [], [], 0
    for task in tasks:
        n = len(task.options)
        scores.append(flat[k:k + n])
        tokens.append(sum(computed[k:k + n]))
        k += n
    params = sum(p.numel() for p in engine.model.parameters())
    return Scored(scores, [max(range(len(s)), key=s.__getitem__) for s in scores], tokens, wall, params)


def confidence(scores: Sequence[float]) -> float:
    """The probability a model gives its own pick: the largest entry of the softmax over its option scores."""
    top = max(scores)
    return 1.0 / sum(math.exp(s - top) for s in scores)


def route(task: Task, small_scores: Sequence[float], threshold: float) -> str:
    """"small" when the small model's confidence in its pick is at least `threshold`, else "target". Reads only
    what is known before the target runs (the task's statement and options, the small model's scores)."""
    return "small" if confidence(small_scores) >= threshold else "target"


@dataclass(frozen=True)
class Point:
    """One router setting: requests kept on the small model, cost (share of always-target's compute), answers
    kept (share equal to the target's own answer), accuracy (share right) and seconds (the models' measured
    times of the tasks each serves, the small model's probe included)."""
    threshold: float
    to_small: int
    cost: float
    kept: float
    accuracy: float
    time_s: float = math.nan


def evaluate(tasks: Sequence[Task], small: Scored, target: Scored, decisions: Sequence[str],
             threshold: float = math.nan, probe: bool = True) -> Point:
    """The cost and quality of one set of routing decisions ("small" or "target" per task). With `probe` the small
    model's cost is paid for every request (it is asked first); without, only where it answers."""
    if any(d not in ("small", "target") for d in decisions):
        raise ValueError(f"a routing decision is 'small' or 'target', got {sorted(set(decisions))}")
    full = sum(target.flops)
    cost = kept = right = seconds = 0.0
    for i, (task, d) in enumerate(zip(tasks, decisions)):
        pick = small.picks[i] if d == "small" else target.picks[i]
        cost += (small.flops[i] if probe or d == "small" else 0.0) + (target.flops[i] if d == "target" else 0.0)
        seconds += (small.seconds[i] if probe or d == "small" else 0.0) + (target.seconds[i] if d == "target" else 0.0)
        kept += pick == target.picks[i]
        right += pick == task.answer
    n = len(tasks)
    return Point(threshold, sum(d == "small" for d in decisions), cost / full, kept / n, right / n, seconds)


def curve(tasks: Sequence[Task], small: Scored, target: Scored, router: Callable = route) -> list[Point]:
    """The router at every threshold that changes a decision (each task's own confidence), from always small
    (threshold 0) to always target (past 1, without the small model's probe), ordered by cost."""
    confs = sorted({confidence(s) for s in small.scores})
    points = [evaluate(tasks, small, target, ["small"] * len(tasks), 0.0)]
    for t in confs[1:]:
        decisions = [router(task, s, t) for task, s in zip(tasks, small.scores)]
        points.append(evaluate(tasks, small, target, decisions, t))
    points.append(evaluate(tasks, small, target, ["target"] * len(tasks), math.inf, probe=False))
    return _up_to_target(points)


def _up_to_target(points: list[Point]) -> list[Point]:
    """Ordered by cost, ending at always target: a setting that costs more (nearly every request sent on after the
    small model's probe) is beaten by always target outright."""
    full = points[-1]
    return sorted([p for p in points[:-1] if p.cost < full.cost], key=lambda p: p.cost) + [full]


def random_curve(tasks: Sequence[Task], small: Scored, target: Scored, seed: int = 0) -> list[Point]:
    """A router that ignores every signal: k requests at random on the small model, for every k (the control)."""
    rng = random.Random(seed)
    order = list(range(len(tasks)))
    rng.shuffle(order)
    points = []
    for k in range(len(tasks) + 1):
        chosen = set(order[:k])
        decisions = ["small" if i in chosen else "target" for i in range(len(tasks))]
        points.append(evaluate(tasks, small, target, decisions, probe=k > 0))
    return _up_to_target(points[:-1] + [evaluate(tasks, small, target, ["target"] * len(tasks), probe=False)])


def _line(points: Sequence[Point]) -> Callable[[float], float]:
    lo, hi = points[0], points[-1]
    return lambda c: lo.kept + (hi.kept - lo.kept) * (c - lo.cost) / (hi.cost - lo.cost)


def gain_over_line(points: Sequence[Point]) -> float:
    """How far the curve rises above the straight line from always small (the cheapest point) to always target
    (the dearest), in answers kept, at its best point (negative: never above it)."""
    if len(points) < 3 or points[-1].cost == points[0].cost:
        return 0.0
    line = _line(points)
    return max(p.kept - line(p.cost) for p in points[1:-1])


def area_over_line(points: Sequence[Point]) -> float:
    """The mean height of the curve above that straight line over the whole cost range (trapezoids between
    settings; negative where it runs below). One lucky setting cannot lift it: a router that ignores its signal
    averages about 0 (a little below: it pays the probe)."""
    if len(points) < 2 or points[-1].cost == points[0].cost:
        return 0.0
    line = _line(points)
    area = sum((b.cost - a.cost) * ((a.kept - line(a.cost)) + (b.kept - line(b.cost))) / 2
               for a, b in zip(points, points[1:]))
    return area / (points[-1].cost - points[0].cost)


def cheapest_keeping(points: Sequence[Point], share: float) -> Point | None:
    """The cheapest point that keeps at least `share` of the target's answers, other than always target."""
    ok = [p for p in points[:-1] if p.kept >= share]
    return min(ok, key=lambda p: p.cost) if ok else None
