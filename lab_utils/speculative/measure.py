"""Side-by-side timing of speculative decoding (used by `benchmarks/spec_decode.py` and lab 07).

One engine per method, built once; every round runs the same prompts through each engine in a rotating order
(so slow spells of a shared machine hit every method alike), and the figures are medians over rounds.
"""
from __future__ import annotations

import statistics
import time

import torch

from lab_utils.engine.config import EngineConfig, SpecConfig
from lab_utils.engine.engine import LLMEngine
from lab_utils.engine.sampling_params import SamplingParams
from lab_utils.speculative.hook import SpecStats


def build_engines(model_tok, methods: dict[str, SpecConfig | None], device: str = "cpu", parts=None,
                  **engine_kw) -> dict[str, LLMEngine]:
    """{name: engine}; a method whose proposer cannot be built (e.g. heads not trained yet) is left out.
    `parts`: the engine parts they run (a learner's verify step, lab 07), None = the engine's own."""
    engines = {}
    kw = dict(kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False) | engine_kw
    for name, spec in methods.items():
        try:
            engines[name] = LLMEngine(model_tok, EngineConfig(speculative=spec, **kw), device=device, parts=parts)
        except (ValueError, OSError) as e:
            print(f"[spec] skipping {name}: {e}")
    return engines


@torch.inference_mode()
def divergence_gap(model, prompt_ids: list[int], a: list[int], b: list[int]) -> float | None:
    """None if the greedy outputs a and b are identical; else the target's top-2 logit gap at the first token
    where they differ (a near-tie, ~1e-4, means float rounding of a k+1-row vs a 1-row forward flipped an
    argmax; a large gap would mean a real bug)."""
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return None if len(a) == len(b) else float("inf")
    ids = torch.tensor([prompt_ids + a[:i]], device=model.device)
    top2 = model(ids)[0, -1].float().topk(2).values
    return float(top2[0] - top2[1])


def run_once(engine: LLMEngine, prompts: list, params: SamplingParams) -> dict:
    """Wall time of generating `prompts` as one batch, with this run's own acceptance statistics."""
    if engine.spec is not None:
        engine.spec.stats = SpecStats(engine.spec.k)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    engine.block_manager.check_all_free()
    n = sum(len(o.token_ids) for o in outs)
    stats = engine.stats()
    return {"wall_s": wall, "tokens": n, "tokens_per_s": n / wall, "token_ids": [o.token_ids for o in outs],
            **{k: v for k, v in stats.items() if k.startswith("spec_")}}


def compare(engines: dict[str, LLMEngine], prompt_batches: list[list], params: SamplingParams, rounds: int = 1,
            baseline: str = "none", progress=None) -> dict:
    """Run every batch through every engine, `rounds` times, rotating the order. Returns per method: the runs,
    the median wall time, the median per-batch speed-up over `baseline`, and whether greedy outputs matched."""
    names = list(engines)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        for b, prompts in enumerate(prompt_batches):
            shift = (r + b) % len(names)
            for name in names[shift:] + names[:shift]:
                run = run_once(engines[name], prompts, params)
                run.update(batch=b, round=r)
                runs[name].append(run)
                if progress is not None:
                    progress(name, run)
    out = {}
    for name in names:
        speedups, same = [], []
        for run in runs[name]:
            if baseline in runs:
                base = next(x for x in runs[baseline] if x["batch"] == run["batch"] and x["round"] == run["round"])
                speedups.append(base["wall_s"] / run["wall_s"] * run["tokens"] / base["tokens"])
                same.append(run["token_ids"] == base["token_ids"])
        acc = [x["spec_num_accepted"] for x in runs[name] if x.get("spec_num_proposed")]
        prop = [x["spec_num_proposed"] for x in runs[name] if x.get("spec_num_proposed")]
        steps = [x["spec_num_verify_steps"] for x in runs[name] if x.get("spec_num_verify_steps")]
        out[name] = {
            "median_wall_s": statistics.median(x["wall_s"] for x in runs[name]),
            "median_tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs[name]),
            "median_speedup": statistics.median(speedups) if speedups else None,
            # the workload's wall time: all batches' time without speculation / all batches' time with it
            "total_wall_speedup": (sum(x["wall_s"] for x in runs[baseline]) / sum(x["wall_s"] for x in runs[name])
                                   if baseline in runs else None),
            "speedups": speedups,
            "greedy_identical": all(same) if same else None,
            "acceptance_rate": sum(acc) / sum(prop) if prop else None,
            "mean_tokens_per_verify_step": (sum(acc) + sum(steps)) / sum(steps) if steps else None,
            "acceptance_per_position": _per_position(runs[name]),
            "runs": [{k: v for k, v in x.items() if k != "token_ids"} for x in runs[name]],
            "outputs": [(x["batch"], x["round"], x["token_ids"]) for x in runs[name]],  # for divergence checks
        }
    return out


def _per_position(runs: list[dict]) -> list[float | None] | None:
    rows = [x["spec_acceptance_per_position"] for x in runs if x.get("spec_acceptance_per_position")]
    if not rows:
        return None
    cols = list(zip(*rows))
    return [statistics.mean(v for v in c if v is not None) if any(v is not None for v in c) else None for c in cols]


@torch.inference_mode()
def pass_cost_ratio(model, rows: int, device, prefix: int = 200, repeat: int = 7, seed: int = 0) -> float:
    """v: the time of one forward pass over `rows` new tokens over that of a pass over one, both on top of a cached
    `prefix`, through the model the engine runs (`fast_linears`: its packed CPU kernels; the model itself on a
    GPU). The two passes alternate and each figure is a median of `repeat`, so a slow spell of a shared machine
    hits both alike (one cold round first). The prefix is computed once: each pass rewinds the cache to it."""
    from lab_utils.device import synchronize
    from lab_utils.engine.accel import fast_linears
    from lab_utils.models.kv_cache_simple import SimpleKVCache

    run = fast_linears(model, torch.device(device))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, 40000, (1, prefix), generator=g).to(device)
    times: dict[int, list[float]] = {1: [], rows: []}
    cache = SimpleKVCache.for_model(model, 1, prefix + rows)
    cache.forward(run, ids)
    for i in range(repeat + 1):
        for n in ((1, rows) if i % 2 else (rows, 1)):
            cache.length = prefix  # rewind: this pass overwrites the last one's rows
            x = torch.randint(100, 40000, (1, n), generator=g).to(device)
            synchronize(device)
            t0 = time.perf_counter()
            cache.forward(run, x)
            synchronize(device)
            if i:
                times[n].append(time.perf_counter() - t0)
    return statistics.median(times[rows]) / statistics.median(times[1])
