"""Checks and claims for lab 15: token efficiency.

`check_fan_out` runs the learner's fan-out on a tiny float64 engine with the prefix cache on, over fresh random
sub-tasks that share a prefix of several blocks, next to the reference (`lab_utils.efficiency.fanout`): the
answers must be those of one-after-another serving (float64: equal tokens), the engine must work on the sub-tasks
together (not one by one), and the prompt tokens the engine computed (its step log) must be the shared prefix once
plus each sub-task's own part; a fan-out that sends everything in one instant computes the prefix once a sub-task
and is named so. `check_prompt_usage` compares the learner's usage count with the engine's own count of what it
computed (cached tokens are not computed). `check_route` runs the learner's router on random option scores next to
the reference (`lab_utils.efficiency.routing.route`) and names a router that reads the task's answer (its decision
changes when only the answer does), one on the wrong side of its threshold and one that thresholds raw
log-probabilities. None shows the solution.
"""
from __future__ import annotations

import random
from collections.abc import Callable

from lab_utils.checks.claims import Claim
from lab_utils.efficiency import fanout, routing

FAN_OUT_PART = "efficiency.fan_out"
ROUTE_PART = "efficiency.route"
USAGE = "prompt_usage (lab 15's exercise, in this notebook: not an engine part)"
AREA_BAR = 0.03  # answers kept above the straight line, averaged over the cost range
SESSION_TOKENS_BAR = 0.5  # the session state's prompt tokens, at most this share of the full history's
SESSION_TTFT_BAR = 1.5  # full history's time to first token over the session state's, at least
ROUTED_TIME_BOUND = 0.35  # a routing setting's time from the per-task times vs its run measured, relative error
BLOCK = 16


def _where(part: str) -> str:
    from lab_utils.checks.parts_check import where

    return where(part)


def _tiny_engine(seed: int = 0, budget: int = 2048):
    import torch

    from lab_utils import LLMEngine, load_model
    from lab_utils.course import learner_parts

    if "tiny" not in _MODELS:
        _MODELS["tiny"] = load_model("tiny-random", device="cpu", dtype=torch.float64)
    config = learner_parts.engine_config("04", block_size=BLOCK, num_gpu_blocks=160, max_num_batched_tokens=budget,
                                         seed=seed)
    return LLMEngine(_MODELS["tiny"], config, device="cpu")


_MODELS: dict = {}


def random_subtasks(rng: random.Random, n: int, prefix_blocks: int) -> list[list[int]]:
    """n prompts: one shared prefix of `prefix_blocks` blocks and a few more tokens, then each its own task."""
    prefix = [rng.randrange(100, 40000) for _ in range(prefix_blocks * BLOCK + rng.randrange(BLOCK))]
    return [prefix + [rng.randrange(100, 40000) for _ in range(rng.randint(3, 2 * BLOCK))] for _ in range(n)]


def _fan_out_trial(rng: random.Random, trial: int):
    """One fan-out case: its prompts, sampling parameters and step budget. Trial 1 has a budget below the first
    prompt's length (its prompt takes several steps); on the others one later sub-task stops at its first token
    (a stop token), so the sub-tasks finish in another order than they were sent."""
    from lab_utils import SamplingParams

    n, blocks = rng.randint(3, 5), rng.randint(4, 6)
    prompts = random_subtasks(rng, n, blocks)
    params = SamplingParams(max_tokens=rng.randint(3, 6))
    budget = 3 * BLOCK if trial % 3 == 1 else 2048
    if budget == 2048:
        want = fanout.one_by_one(_tiny_engine(), prompts, params)
        firsts = [w.token_ids[0] for w in want[1:] if w.token_ids[0] not in want[0].token_ids]
        if firsts:
            params = SamplingParams(max_tokens=params.max_tokens, stop_token_ids=[firsts[-1]])
    return prompts, params, budget


def _first_prompt_before_the_rest(what: str, step_log: list[dict], got: list, budget: int) -> None:
    """From the step log: no other sub-task runs before the first one's prompt is computed (the contract's fork)."""
    ids = {o.request_id: len(o.prompt_token_ids) for o in got}
    first = next((rid for step in step_log for rid, _ in step["requests"] if rid in ids), None)
    done = 0
    for k, step in enumerate(step_log):
        others = [rid for rid, _ in step["requests"] if rid in ids and rid != first]
        if others and done < ids[first]:
            raise AssertionError(
                f"{what}: in step {k + 1} (the step log) another sub-task ran while the first had computed {done} of "
                f"its {ids[first]} prompt tokens: it could not find the shared prefix in the cache. Step until the "
                f"first has produced its first token (its prompt can take several steps of {budget} tokens), then "
                "send the rest")
        done += sum(n for rid, n in step["requests"] if rid == first)


def check_fan_out(fn: Callable, seed: int | None = 0, trials: int = 3) -> None:
    """`fn(engine, prompts, params) -> list[RequestOutput]` on random sub-tasks sharing a prefix: the answers of
    one-by-one serving, in prompt order (also when they finish in another), the sub-tasks in the same engine steps
    (from its step log), the shared prefix computed once (also when the first prompt takes several steps).
    Submits `fn`."""
    from lab_utils.course import learner_parts

    part = _where(FAN_OUT_PART)
    rng = random.Random(seed)
    for trial in range(trials):
        prompts, params, budget = _fan_out_trial(rng, trial)
        n = len(prompts)
        want = fanout.one_by_one(_tiny_engine(budget=budget), prompts, params)
        best = _tiny_engine(budget=budget)
        floor = fanout.prompt_tokens_computed(best, fanout.fan_out(best, prompts, params))
        engine = _tiny_engine(budget=budget)
        got = fn(engine, prompts, params)
        what = (f"{part}: {n} sub-tasks sharing a {fanout.shared_prefix_len(prompts)}-token prefix (block size "
                f"{BLOCK}, {budget} tokens a step{', a stop token' if params.stop_token_ids else ''})")
        if not isinstance(got, (list, tuple)) or len(got) != n:
            raise AssertionError(f"{what}: return one RequestOutput per prompt, as a list; got "
                                 f"{type(got).__name__} of length {len(got) if hasattr(got, '__len__') else '?'}")
        for i, (o, p) in enumerate(zip(got, prompts)):
            if not getattr(o, "finished", False):
                raise AssertionError(f"{what}: output {i} is not finished: return each request's final output "
                                     "(step until every request has finished)")
            if list(o.prompt_token_ids) != list(p):
                finished_first = params.stop_token_ids and any(list(o.prompt_token_ids) == list(q) for q in prompts)
                raise AssertionError(f"{what}: output {i} answers another prompt: return the outputs in the order "
                                     "of the prompts (a step's outputs come in no promised order"
                                     + ("; here a later sub-task finished first: collect the outputs by request id, "
                                        "not in the order they finish" if finished_first else "") + ")")
        for i, (o, w) in enumerate(zip(got, want)):
            if list(o.token_ids) != list(w.token_ids):
                raise AssertionError(f"{what}: sub-task {i}'s answer {list(o.token_ids)} differs from one-by-one "
                                     f"serving's {list(w.token_ids)} (greedy, float64: they must be equal)")
        ids = [o.request_id for o in got]
        steps = [{rid for rid, _ in step["requests"]} & set(ids) for step in engine.step_log]
        alone = [i for i, rid in enumerate(ids) if not any(rid in s and len(s) > 1 for s in steps)]
        together = fanout.max_batch(engine)
        if alone and together >= n - 1:
            raise AssertionError(f"{what}: sub-task {alone[0]} ran in no engine step with another sub-task (the "
                                 "step log): it ran to the end before the others were sent. The sub-tasks run in "
                                 "the same steps: add the others as soon as the first has produced its first token")
        if together < n - 1:
            raise AssertionError(f"{what}: at most {together} of them were in one engine step: they ran one after "
                                 "another. Fan out: once the first has its prompt computed, add all the others "
                                 "before stepping again, so the engine decodes them together")
        computed = fanout.prompt_tokens_computed(engine, got)
        if computed > floor + BLOCK:
            shared = fanout.shared_prefix_len(prompts)
            times = (computed - (floor - shared)) / shared
            chunked = len(prompts[0]) > budget
            raise AssertionError(
                f"{what}: the engine computed {computed} prompt tokens, {floor} when the shared prefix is computed "
                f"once: it computed the shared prefix about {times:.1f} times. Requests admitted in the same step all "
                "miss the prefix cache (their blocks are named only once computed): send one sub-task first and "
                "step until it has produced its first token, then the rest"
                + (f" (here its {len(prompts[0])}-token prompt takes more than one step of {budget} tokens: one step "
                   "is not enough)" if chunked else ""))
        _first_prompt_before_the_rest(what, engine.step_log, got, budget)
    print(f"✔ check_fan_out: {trials} fan-outs of 3-5 sub-tasks (one with a prompt longer than a step's budget): the "
          "same answers as one by one, in prompt order, worked on in the same steps, the shared prefix computed once")
    learner_parts.submit(FAN_OUT_PART, fn)


def check_prompt_usage(fn: Callable, seed: int | None = 0) -> None:
    """`fn(outputs) -> {"prompt_tokens", "cached_tokens", "computed_tokens"}` against the engine's own count of
    the prompt tokens it computed, on a run where most prompt tokens come from the prefix cache."""
    from lab_utils import SamplingParams

    rng = random.Random(seed)
    prompts = random_subtasks(rng, 4, 5)
    engine = _tiny_engine()
    outs = fanout.fan_out(engine, prompts, SamplingParams(max_tokens=3))
    truth = fanout.prompt_tokens_computed(engine, outs)
    got = fn(outs)
    want = fanout.prompt_usage(outs)
    if not isinstance(got, dict) or set(got) != set(want):
        raise AssertionError(f"{USAGE}: return a dict with the keys {sorted(want)}; got "
                             f"{sorted(got) if isinstance(got, dict) else type(got).__name__}")
    for key in ("prompt_tokens", "cached_tokens"):
        if got[key] != want[key]:
            raise AssertionError(f"{USAGE}: {key}: {got[key]}, expected {want[key]} (the sum over the outputs)")
    if got["computed_tokens"] != truth:
        mistake = (" : that is every prompt token, cached ones counted as computed (a token found in the prefix "
                   "cache is not run through the model)" if got["computed_tokens"] == want["prompt_tokens"] else "")
        raise AssertionError(f"{USAGE}: computed_tokens: {got['computed_tokens']}, but the engine's step log shows it ran "
                             f"{truth} prompt tokens{mistake}")
    print(f"✔ check_prompt_usage: {truth} of {want['prompt_tokens']} prompt tokens computed, as the engine counts them")


def _route_cases(rng: random.Random, n: int) -> list[tuple]:
    """(task, small_scores, threshold) cases: the course's tasks, random option scores, thresholds in (0.3, 1)."""
    from lab_utils.efficiency.tasks import routing_tasks

    tasks = routing_tasks(rng.randrange(1000))
    cases = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        scores = [rng.uniform(-12.0, -0.5) for _ in task.options]
        tie = i % 10 == 3  # a confidence exactly at the threshold: the contract's ">="
        cases.append((task, scores, routing.confidence(scores) if tie else rng.uniform(0.3, 0.99)))
    return cases


def check_route(fn: Callable, seed: int | None = 0, cases: int = 300) -> None:
    """`fn(task, small_scores, threshold) -> "small" | "target"` against the reference on random option scores;
    names a router that reads the task's answer, one on the wrong side of its threshold and one that thresholds
    raw log-probabilities. Submits `fn`."""
    import dataclasses

    from lab_utils.course import learner_parts

    rng = random.Random(seed)
    got, want, raw = [], [], []
    for task, scores, threshold in _route_cases(rng, cases):
        decision = fn(task, list(scores), threshold)
        if decision not in ("small", "target"):
            raise AssertionError(f"{_where(ROUTE_PART)}: return 'small' or 'target', got {decision!r}")
        other = dataclasses.replace(task, answer=(task.answer + 1) % len(task.options))
        if fn(other, list(scores), threshold) != decision:
            raise AssertionError(
                f"{_where(ROUTE_PART)}: {task.prompt!r} {task.options}: your router decided differently when only task.answer changed: it "
                "reads the answer, which no router has when it decides (the lab grades with it). Route from the "
                "small model's scores (and the statement and options) only")
        got.append(decision)
        want.append(routing.route(task, scores, threshold))
        raw.append("small" if max(scores) >= threshold else "target")
    if got != want:
        i = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
        flipped = sum(a != b for a, b in zip(got, want))
        if flipped == len(got):
            why = ("every decision is the other side: a confident small model (confidence >= threshold) keeps the "
                   "request; a doubtful one sends it to the target")
        elif all(a == "target" and b == "small" and routing.confidence(c[1]) == c[2]
                 for a, b, c in zip(got, want, _route_cases(random.Random(seed), len(got))) if a != b):
            why = ("each differing case has a confidence exactly equal to the threshold: that request stays on the "
                   "small model (confidence >= threshold, not >)")
        elif got == raw:
            why = ("you thresholded a raw log-probability: the confidence is the probability the small model gives its "
                   "own pick, the largest entry of the softmax over its option scores (between 0 and 1)")
        else:
            why = "the confidence is the largest entry of the softmax over the small model's option scores"
        task, scores, threshold = _route_cases(random.Random(seed), i + 1)[i]
        raise AssertionError(f"{_where(ROUTE_PART)}: scores {[round(x, 2) for x in scores]}, threshold "
                             f"{threshold:.3f}: your router says "
                             f"{got[i]!r}, expected {want[i]!r} (confidence {routing.confidence(scores):.3f}); "
                             f"{flipped} of {len(got)} decisions differ: {why}")
    print(f"✔ check_route: {cases} random cases decided as the reference, and never from the answer")
    learner_parts.submit(ROUTE_PART, fn)


def routing_claims(r: dict, model: str | None = None) -> list[Claim]:
    """The routing claims: the curve of the learner's router (`curve`, points with cost and kept) against the
    straight line between its endpoints, beside a router that ignores its signal (`random_curve`); with
    `time_point` (a point of the curve) and `routed_walls` (that setting run for real, twice), its time from the
    per-task times against the measured one. With a random-weight target (`model`) the answers kept are NOT
    JUDGED: the trade needs a target that answers better than the small model."""
    from lab_utils.checks.claims import need, parts_called, trained_only

    need(r, "curve", "random_curve", "route_calls")
    pts, rnd = r["curve"], r["random_curve"]
    small, full = pts[0], pts[-1]
    area, best, area_rnd = (routing.area_over_line(pts), routing.gain_over_line(pts),
                            routing.area_over_line(rnd))
    timed = []
    if "time_point" in r:
        from lab_utils.checks.timing import judge_error

        point, walls = r["time_point"], r["routed_walls"]
        mean = sum(walls) / len(walls)
        err = abs(point.time_s - mean) / mean
        timed = [judge_error(
            f"measured: at threshold {point.threshold:.3f} the per-task times give {point.time_s:.2f} s and the setting "
            f"run for real took {', '.join(f'{w:.2f}' for w in walls)} s: {err:.0%} apart (bound "
            f"{ROUTED_TIME_BOUND:.0%})", {"routed": err}, {"routed": (max(walls) - min(walls)) / mean},
            ROUTED_TIME_BOUND, "rerun the routing cells on a quieter machine")]
    return [
        trained_only((f"measured: always small costs {small.cost:.0%} of always target's compute and keeps "
                      f"{small.kept:.0%} of its answers (both endpoints measured in this run): routing has something "
                      "to trade", small.cost < full.cost and small.kept < full.kept), model),
        trained_only((f"measured: your router's curve lies above the straight line between the endpoints by "
                      f"{area:+.3f} answers kept on average over the cost range (best setting {best:+.3f}; bar "
                      f"{AREA_BAR}); a router that ignores its signal: {area_rnd:+.3f}", area >= AREA_BAR), model),
        parts_called("the routing curve", r["route_calls"], [ROUTE_PART]),
    ] + timed


def contexts_claims(r: dict, model: str | None = None) -> list[Claim]:
    """The shorter-context claims, from `lab_utils.efficiency.contexts.summary`: prompt tokens per variant, answers
    kept (agreement with the target's greedy answer under the full history), the compressor's budgets and
    whole-word verdicts, per-round first-token times (the compressor's with its scoring pass); `step_logs`: the
    reader engine's step logs of those timings. The session state's TTFT claim is judged where this device's step
    costs, fitted on them, predict it (a prefill's cost grows with its tokens, as on a CPU); where a prefill costs
    about the same at 70 or 250 tokens (a launch-bound GPU) it is NOT JUDGED, saying so."""
    from lab_utils.checks.claims import need, trained_only
    from lab_utils.checks.timing import StepCosts, device_condition, judge, ratios

    need(r, "turns", "k", "tokens", "kept", "budgets", "compressed_sizes", "whole_words", "ttft_s", "scoring_tokens",
         "step_logs")
    n, k, tokens, kept, t = r["turns"], r["k"], r["tokens"], r["kept"], r["ttft_s"]
    costs = StepCosts.fit(r["step_logs"])
    ttft_predicted = costs.cost(tokens["full"] / n) / costs.cost(tokens["session"] / n)  # one prefill a turn
    over = [(s, b) for s, b in zip(r["compressed_sizes"], r["budgets"]) if s > b]
    shorter = {v: kept[v] for v in ("last", "session", "compressed")}
    return [
        (f"measured: lab 11's session state sent {tokens['session']} prompt tokens over {n} turns, "
         f"{tokens['session'] / tokens['full']:.0%} of the full history's {tokens['full']} (bar "
         f"{SESSION_TOKENS_BAR:.0%})", tokens["session"] <= SESSION_TOKENS_BAR * tokens["full"]),
        device_condition(
            judge(f"measured: the session state reached the first token >= {SESSION_TTFT_BAR}x sooner than the full "
                  "history", ratios(t["full"], t["session"]), SESSION_TTFT_BAR,
                  "rerun the timing cell on a quieter machine"),
            ttft_predicted, SESSION_TTFT_BAR, costs, f"a prefill of the full history's {tokens['full'] / n:.0f} "
            f"tokens a turn to cost well over one of the session state's {tokens['session'] / n:.0f}"),
        (f"measured: the compressor met its budget on {n - len(over)}/{n} turns"
         + (f" (over: {over[:3]})" if over else "")
         + f" and dropped only whole history words, every template token, the system message and the question kept "
         f"on {r['whole_words']}/{n}", not over and r["whole_words"] == n),
        judge(f"measured: the compressor, its scoring pass counted ({r['scoring_tokens']} tokens prefilled by the "
              "target), reached the first token no sooner than the full history: scoring by the target costs a "
              "full prefill", ratios(t["compressed"], t["full"]), 1.0, "rerun the timing cell on a quieter machine"),
        (f"measured: the check agrees with generation: under the full history the target's most likely tokens are "
         f"its own greedy answer's first {k} on {kept['full']:.0%} of the turns (or a near-tie)", kept["full"] == 1.0),
        # a random-weight target's answers barely depend on the context: whether they change says nothing
        trained_only(("measured, not assumed: every shorter context lost answers (kept: "
                      + ", ".join(f"{v} {x:.0%}" for v, x in shorter.items()) + ")", max(shorter.values()) < 1.0),
                     model),
    ]


def claims(r: dict) -> list[Claim]:
    """Lab 15's claims from the run's measurements: per serving mode ("one by one", "all at once", "fan-out")
    the engine's computed prompt tokens (`computed`), the most requests in one step (`batch`), the per-round wall
    times (`wall_s`), the shared prefix length and sub-task count, answers that agree, the learner's usage count
    and the calls of the learner's fan-out."""
    from lab_utils.checks.claims import need, parts_called
    from lab_utils.checks.timing import judge, ratios

    need(r, "computed", "batch", "wall_s", "prefix_tokens", "subtasks", "suffix_tokens", "answers_same",
         "usage_computed", "calls")
    comp, n, prefix, suffix = r["computed"], r["subtasks"], r["prefix_tokens"], r["suffix_tokens"]
    once = prefix + suffix  # the shared prefix once, each sub-task's own tokens once
    slack = BLOCK * n  # a match ends at a block boundary: up to a block a sub-task recomputed
    fan, naive = comp["fan-out"], comp["all at once"]
    out = [
        (f"measured: the fan-out computed {fan} prompt tokens: the {prefix}-token shared prefix once plus the "
         f"sub-tasks' own {suffix} (bound {once + slack}, a block of slack a sub-task)", fan <= once + slack),
        (f"measured: sent all at once, the engine computed {naive} prompt tokens: the shared prefix about "
         f"{(naive - suffix) / prefix:.1f} times (requests admitted in one step all miss the cache)",
         naive >= n * prefix + suffix - slack),
        (f"measured: the fan-out worked on the {n} sub-tasks together (up to {r['batch']['fan-out']} in a step; one "
         f"by one: {r['batch']['one by one']})", r["batch"]["fan-out"] >= n - 1 and r["batch"]["one by one"] == 1),
        judge(f"measured: the fan-out finished the {n} sub-tasks >= 1.5x faster than one by one",
              ratios(r["wall_s"]["one by one"], r["wall_s"]["fan-out"]), 1.5,
              "rerun the timing cell on a quieter machine"),
        (f"measured: the same answers fanned out as one by one ({r['answers_same']}/{n}, greedy; or parting at a "
         "near-tie of the dtype)", r["answers_same"] == n),
        (f"your prompt_usage counted {r['usage_computed']} computed prompt tokens, the engine's step log {fan}",
         r["usage_computed"] == fan),
        parts_called("the fan-out", r["calls"], [FAN_OUT_PART]),
    ]
    out += routing_claims(r["routing"], r.get("model")) if "routing" in r else []
    return out + (contexts_claims(r["contexts"], r.get("model")) if "contexts" in r else [])


def assert_claims(r: dict, show: bool = True) -> None:
    """Print lab 15's claims; AssertionError naming each one that fails."""
    from lab_utils.checks.claims import report

    report(claims(r), show)


# every check_* above also records its result in the learner's own log (lab_utils.workshop.records)
from lab_utils.workshop.records import record_checks  # noqa: E402

record_checks(globals())
