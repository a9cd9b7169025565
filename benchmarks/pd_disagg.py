"""TTFT and ITL under a mixed workload: colocated vs colocated with chunked prefill vs P/D disaggregated.

    python benchmarks/pd_disagg.py --model smollm2-135m   # defaults: the run in docs/RESULTS.md

Workload: short requests (chat turns) decode while long prompts (documents) arrive. Colocated without chunking,
a long prefill runs as one step and every running decode waits for it (an ITL spike); chunked prefill caps a
step at `--chunk` tokens; disaggregated, the decode worker never prefills and receives the KV instead (bytes and
time per transfer reported). All three see the same arrivals; greedy outputs are compared. Note the hardware:
the disaggregated cluster uses two worker processes (one thread each), the colocated engine one thread.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from lab_utils import EngineConfig, SamplingParams
from lab_utils.bench.metrics import summarize
from lab_utils.disagg import DisaggregatedCluster, colocated_run


def workload(n_short: int, n_long: int, short_len: int, long_len: int, short_out: int, long_out: int,
             long_every: float, seed: int = 0):
    rng = random.Random(seed)
    prompts, params, arrivals, kinds = [], [], [], []
    for i in range(n_short):
        prompts.append([rng.randrange(100, 40000) for _ in range(short_len)])
        params.append(SamplingParams(max_tokens=short_out, ignore_eos=True))
        arrivals.append(0.05 * i)
        kinds.append("short")
    for j in range(n_long):
        prompts.append([rng.randrange(100, 40000) for _ in range(long_len)])
        params.append(SamplingParams(max_tokens=long_out, ignore_eos=True))
        arrivals.append(long_every * (j + 1))
        kinds.append("long")
    return prompts, params, arrivals, kinds


def metrics_of(outs, kinds) -> dict:
    ms = [o.metrics for o in outs]
    res = {"all": summarize(ms)}
    for k in ("short", "long"):
        res[k] = summarize([m for m, kk in zip(ms, kinds) if kk == k])
    keep = ("median_ttft_ms", "p90_ttft_ms", "median_itl_ms", "p90_itl_ms", "p99_itl_ms", "median_tpot_ms",
            "output_throughput", "duration")
    return {k: {x: v[x] for x in keep} for k, v in res.items()}


def median_over_rounds(results: dict[str, list]) -> dict:
    """Per system, class and metric: the median over rounds (the machine is shared, so rounds differ)."""
    import statistics

    return {s: {k: {m: statistics.median(r[k][m] for r in runs) for m in runs[0][k]} for k in runs[0]}
            for s, runs in results.items() if runs}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-short", type=int, default=4)
    ap.add_argument("--n-long", type=int, default=2)
    ap.add_argument("--short-len", type=int, default=32)
    ap.add_argument("--long-len", type=int, default=256)
    ap.add_argument("--short-out", type=int, default=32)
    ap.add_argument("--long-out", type=int, default=8)
    ap.add_argument("--long-every", type=float, default=2.0)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    prompts, params, arrivals, kinds = workload(a.n_short, a.n_long, a.short_len, a.long_len, a.short_out,
                                                a.long_out, a.long_every)
    max_len = 1024
    whole = EngineConfig(max_num_seqs=16, max_model_len=max_len, max_num_batched_tokens=max_len,
                         enable_chunked_prefill=False, enable_prefix_caching=False)
    chunked = EngineConfig(max_num_seqs=16, max_model_len=max_len, max_num_batched_tokens=a.chunk,
                           enable_chunked_prefill=True, enable_prefix_caching=False)
    systems = ["colocated", "colocated_chunked", "disaggregated"]
    results: dict[str, list] = {s: [] for s in systems}
    tokens: dict[str, list] = {}
    transfer = None
    with DisaggregatedCluster(a.model, whole) as cluster:  # started once, reused each round
        for r in range(a.rounds):
            for system in (systems if r % 2 == 0 else systems[::-1]):
                t0 = time.perf_counter()
                if system == "disaggregated":
                    outs = cluster.generate(prompts, params, arrival_times=arrivals)
                    transfer = cluster.transfer_stats()
                else:
                    outs = colocated_run(a.model, whole if system == "colocated" else chunked, prompts, params,
                                         arrival_times=arrivals)
                m = metrics_of(outs, kinds)
                results[system].append(m)
                tokens.setdefault(system, [o.token_ids for o in outs])
                print(f"round {r} {system:18s} {time.perf_counter() - t0:5.1f} s  "
                      f"TTFT p50 {m['all']['median_ttft_ms']:7.0f} ms  ITL(short) p50 {m['short']['median_itl_ms']:6.0f} "
                      f"p90 {m['short']['p90_itl_ms']:6.0f} p99 {m['short']['p99_itl_ms']:6.0f} ms", flush=True)
    out = dict(
        benchmark="pd_disagg", model=a.model, device="cpu", date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine=platform.machine(), torch=torch.__version__, args=vars(a),
        workload=dict(n_short=a.n_short, n_long=a.n_long, short_len=a.short_len, long_len=a.long_len,
                      short_out=a.short_out, long_out=a.long_out, arrivals=arrivals, kinds=kinds),
        outputs_identical={s: tokens[s] == tokens["colocated"] for s in systems},
        median=median_over_rounds(results), results=results, transfer_stats=transfer,
        note="disaggregated = 2 worker processes x 1 thread; colocated = 1 process x 1 thread; "
             "ITL/TTFT in ms from lab_utils.bench.metrics.summarize",
    )
    path = Path(a.json or Path(__file__).parent / "results" / f"pd_disagg-{a.model}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps({"outputs_identical": out["outputs_identical"], "transfer_stats": transfer}, indent=1))
    return out


if __name__ == "__main__":
    main()
