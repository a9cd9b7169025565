"""Speculative decoding at batch 1 (and a batch sweep): no speculation vs n-gram vs draft model vs Medusa vs
EAGLE, side by side on the same prompts, alternating order, medians.

    python benchmarks/spec_decode.py --workload quote --num-prompts 3 --max-tokens 96 --json out.json
    python benchmarks/spec_decode.py --workload chat --methods none draft --batch-sizes 1 2 4 8

Speed-up = (baseline wall time / method wall time) per prompt batch, median over batches and rounds, and for
the whole workload (sum of baseline wall times / sum of the method's); greedy outputs are compared token by
token with the baseline (they should be identical).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from lab_utils import SamplingParams, load_model
from lab_utils.engine.config import SpecConfig
from lab_utils.speculative.measure import build_engines, compare
from lab_utils.speculative.training.workloads import WORKLOADS, make_prompts


def method_configs(methods: list[str], ks: list[int], draft: str | None, lookup_min: int, lookup_max: int,
                   draft_quantization: str | None = None) -> dict:
    """{"none": None, "ngram k=4": SpecConfig(...), ...}: every method at every k."""
    cfgs = {}
    for m in methods:
        if m == "none":
            cfgs[m] = None
            continue
        for k in ks:
            if m == "ngram":
                cfgs[f"{m} k={k}"] = SpecConfig("ngram", k, prompt_lookup_min=lookup_min, prompt_lookup_max=lookup_max)
            elif m == "draft":
                cfgs[f"{m} k={k}"] = SpecConfig("draft", k, model=draft, quantization=draft_quantization)
            else:
                cfgs[f"{m} k={k}"] = SpecConfig(m, k)
    return cfgs


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workload", default="quote", choices=sorted(WORKLOADS))
    ap.add_argument("--methods", nargs="+", default=["none", "ngram", "draft", "medusa", "eagle"])
    ap.add_argument("--k", nargs="+", type=int, default=[4], help="num_speculative_tokens (several: one column each)")
    ap.add_argument("--draft", default=None, help="draft model (default data/models/smollm2-draft)")
    ap.add_argument("--draft-quantization", default=None, choices=["int8", "int4", "w8a8", "w8a8-g32"],
                    help="quantize the draft's weights (lm head included); with --draft smollm2-135m: a self-draft")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=5)
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    model_tok = load_model(a.model, device="cpu", dtype=torch.float32)
    engines = build_engines(model_tok, method_configs(a.methods, a.k, a.draft, a.lookup_min, a.lookup_max,
                                                        a.draft_quantization))
    params = SamplingParams(max_tokens=a.max_tokens)
    result = {"machine": f"{os.cpu_count()}-core {platform.machine()} CPU", "load_avg_1m_start": os.getloadavg()[0],
              "omp_num_threads": torch.get_num_threads(), "platform": platform.platform(),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "args": vars(a), "methods": list(engines), "by_batch_size": {}}

    def show(name, run):
        acc = run.get("spec_acceptance_rate")
        print(f"  b={len(run['token_ids'])} {name:10s} {run['wall_s']:6.2f}s {run['tokens']:4d} tok "
              f"acc={'-' if acc is None else f'{acc:.2f}'}", flush=True)

    for bs in a.batch_sizes:
        prompts = make_prompts(a.workload, model_tok[1], a.num_prompts * bs, seed=a.seed)
        batches = [prompts[i * bs:(i + 1) * bs] for i in range(a.num_prompts)]
        print(f"batch size {bs}: {len(batches)} batches x {len(engines)} methods x {a.rounds} rounds", flush=True)
        summary = compare(engines, batches, params, rounds=a.rounds, progress=show)
        result["by_batch_size"][str(bs)] = {n: {k: v for k, v in s.items() if k != "outputs"} for n, s in summary.items()}
        for name, s in summary.items():
            sp, acc, tps = s["median_speedup"], s["acceptance_rate"], s["mean_tokens_per_verify_step"]
            print(f"  => {name:10s} speed-up {sp:.2f}x (median per prompt), {s['total_wall_speedup']:.2f}x (total wall)  acceptance {'-' if acc is None else f'{acc:.2f}'}  "
                  f"tokens/verify {'-' if tps is None else f'{tps:.2f}'}  identical={s['greedy_identical']}")
    result["load_avg_1m_end"] = os.getloadavg()[0]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
        print("wrote", a.json)
    return result


if __name__ == "__main__":
    main()
