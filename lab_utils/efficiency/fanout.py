"""Agent parallelism: N sub-tasks that share a long instruction prefix, one after another or fanned out at once.

An agent that splits a job into sub-tasks sends N prompts that start with the same long instructions. Sent one
after another, each waits for the one before (N prefills, N decode loops); with prefix caching the instructions
are computed once, by the first. Sent all at once, the engine decodes them in one batch, but this engine's prefix
cache names a block only once it is computed: requests admitted in the same step all miss it, and each computes
the shared prefix again. (vLLM names a block when it schedules it, `vllm/v1/core/kv_cache_manager.py`:
`allocate_slots` -> `cache_blocks`, so its same-step requests share the prefix; SGLang's cache-aware policy holds
back waiting requests that share a prefix until one has computed it, `sglang/srt/managers/schedule_policy.py`.)
The fork that gets both here: send one sub-task, let its prompt be computed (its full blocks are then named in
the cache), then send the rest together.

The engine's own count of what it computed (`prompt_tokens_computed`, from `LLMEngine.step_log`) is the measure:
a prompt token served from the cache costs no prefill.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from lab_utils.engine.request import RequestOutput
from lab_utils.engine.sampling_params import SamplingParams


def run_until_done(engine, ids: Sequence[str], done: dict[str, RequestOutput] | None = None) -> list[RequestOutput]:
    """Step the engine until every request in `ids` has finished; their final outputs, in the order of `ids`."""
    done = {} if done is None else done
    while any(i not in done for i in ids):
        if not engine.has_unfinished():
            raise RuntimeError(f"the engine has no work left but requests {[i for i in ids if i not in done]} "
                               "never finished")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def one_by_one(engine, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[RequestOutput]:
    """Each sub-task is sent when the one before has finished (an agent loop that waits for every answer)."""
    return [engine.generate([p], params)[0] for p in prompts]


def all_at_once(engine, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[RequestOutput]:
    """Every sub-task sent in the same instant: one batch, but admitted together they all miss the prefix cache."""
    return engine.generate(list(prompts), params)


def fan_out(engine, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[RequestOutput]:
    """Fork, then fan out: the first sub-task alone until its first token (its prompt is computed and its full
    blocks named in the prefix cache), then every other one at once; they find the shared prefix cached and decode
    in one batch with the first. Outputs in the order of the prompts."""
    done: dict[str, RequestOutput] = {}
    first = engine.add_request(prompts[0], params)
    while not any(out.request_id == first for out in _step_into(engine, done)):
        pass  # each step's outputs are the requests that produced a token: the first's means its prompt is done
    ids = [first] + [engine.add_request(p, params) for p in prompts[1:]]
    return run_until_done(engine, ids, done)


def _step_into(engine, done: dict[str, RequestOutput]) -> list[RequestOutput]:
    """One engine step; finished outputs go into `done`; the step's outputs are returned."""
    outs = engine.step()
    for out in outs:
        if out.finished:
            done[out.request_id] = out
    return outs


def prompt_tokens_computed(engine, outputs: Sequence[RequestOutput]) -> int:
    """Prompt tokens the engine really ran through the model for `outputs` (an engine that served only these,
    with `keep_history`): every token its steps computed, less one decode token per output token after the first.
    A prompt token found in the prefix cache is not computed. Preemption would recompute tokens: refused."""
    if not engine.keep_history:
        raise ValueError("prompt_tokens_computed reads engine.step_log: build the engine with keep_history on")
    if engine.stats()["num_preemptions"]:
        raise ValueError("this run preempted requests (recomputed tokens): give the engine more KV blocks")
    ran = sum(step["num_tokens"] for step in engine.step_log)
    return ran - sum(max(len(o.token_ids) - 1, 0) for o in outputs)


def max_batch(engine) -> int:
    """The most requests one step of this engine's run worked on (1: they ran one after another)."""
    return max((len(step["requests"]) for step in engine.step_log), default=0)


def shared_prefix_len(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the token prefix every prompt starts with."""
    first = list(prompts[0])
    n = len(first)
    for p in prompts[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], p)) if a != b), min(n, len(p)))
    return n


def prompt_usage(outputs: Sequence[RequestOutput]) -> dict[str, int]:
    """Prompt usage of a run as a bill reads it: prompt tokens, those served from the prefix cache (OpenAI's
    `usage.prompt_tokens_details.cached_tokens`) and those the engine computed (the rest)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached}


def measure(modes: Mapping[str, Callable], make_engine: Callable[[], object], prompts: Sequence[Sequence[int]],
            params: SamplingParams, rounds: int) -> dict[str, list[dict]]:
    """Each serving mode `fn(engine, prompts, params)` on a fresh engine, interleaved `rounds` times (after one
    untimed warm-up run): per mode, per round, its wall time, outputs, prompt tokens computed and largest step."""
    from lab_utils.bench.rounds import interleave

    def serve(fn: Callable) -> dict:
        engine = make_engine()
        t0 = time.perf_counter()
        outs = fn(engine, prompts, params)
        wall = time.perf_counter() - t0
        return {"wall": wall, "outs": outs, "computed": prompt_tokens_computed(engine, outs),
                "batch": max_batch(engine)}

    serve(next(iter(modes.values())))  # the first run pays one-off costs (allocations, kernel choices)
    return interleave({name: (lambda fn=fn: serve(fn)) for name, fn in modes.items()}, rounds)


def summary(runs: Mapping[str, list[dict]], prompts: Sequence[Sequence[int]]) -> dict:
    """What lab 15's fan-out claims read from `measure`'s runs: per mode the last round's computed prompt tokens and
    largest step, every round's wall time; the shared prefix, the sub-tasks' own tokens and their count."""
    prefix = shared_prefix_len(prompts)
    return {"computed": {m: rs[-1]["computed"] for m, rs in runs.items()},
            "batch": {m: rs[-1]["batch"] for m, rs in runs.items()},
            "wall_s": {m: [r["wall"] for r in rs] for m, rs in runs.items()},
            "prefix_tokens": prefix, "suffix_tokens": sum(len(p) - prefix for p in prompts), "subtasks": len(prompts)}
