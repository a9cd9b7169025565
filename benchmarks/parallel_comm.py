"""Tensor (TP=2) and pipeline (PP=2) parallelism vs one process: tokens/s and the communication share of a step.

    python benchmarks/parallel_comm.py --model smollm2-135m --max-tokens 16 --rounds 2

Each mode runs `--rounds` times, in alternating order (single, tp, pp, then pp, tp, single, ...), so a load
change on a shared machine hits every mode alike; the JSON keeps every run and the medians. Greedy outputs of
every run are compared with the single-process run (fp32: TP sums partial products in a different order, so a
near-tie could in principle flip a token; `identical_to_single` says whether it did).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from lab_utils.parallel import run_parallel

PROMPTS = ["The capital of France is", "def add(a, b):", "Water boils at", "Once upon a time, in a small village,"]


def summarize_run(res, max_tokens: int) -> dict:
    decode = [t for i, t in enumerate(res.step_times_s) if i % max_tokens]  # step 0 of each prompt is its prefill
    return dict(
        total_time_s=res.total_time_s, tokens_per_s=res.tokens_per_s, startup_s=res.startup_s,
        median_decode_step_ms=statistics.median(decode) * 1e3 if decode else None,
        comm_time_s=res.comm_time_s, comm_share=res.comm_share, bytes_communicated=res.bytes_communicated,
        bytes_per_step=res.bytes_per_step, comm_calls_per_step=res.comm_calls / max(len(res.step_times_s), 1),
        latency_per_call_us=res.latency_per_call_s * 1e6, transfer_time_estimate_s=res.transfer_time_estimate_s,
        wait_time_estimate_s=res.wait_time_estimate_s,
        transfer_share_estimate=res.transfer_time_estimate_s / sum(res.step_times_s),
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    modes = ["single", "tp", "pp"]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    tokens: dict[str, list] = {}
    for r in range(a.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            res = run_parallel(a.model, PROMPTS, max_tokens=a.max_tokens, mode=mode, world_size=2, device=a.device)
            runs[mode].append(summarize_run(res, a.max_tokens))
            tokens.setdefault(mode, res.token_ids)
            print(f"round {r} {mode:6s} {res.tokens_per_s:6.1f} tok/s  comm share {res.comm_share:.0%}  "
                  f"startup {res.startup_s:.0f} s", flush=True)
    med = {m: {k: statistics.median(x[k] for x in runs[m]) for k in runs[m][0] if runs[m][0][k] is not None}
           for m in modes}
    out = dict(
        benchmark="parallel_comm", model=a.model, device=a.device, world_size=2, max_tokens=a.max_tokens,
        prompts=PROMPTS, rounds=a.rounds, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine=platform.machine(), torch=torch.__version__, threads_per_rank=1,
        identical_to_single={m: tokens[m] == tokens["single"] for m in modes},
        median=med, runs=runs,
        speedup_vs_single={m: med[m]["tokens_per_s"] / med["single"]["tokens_per_s"] for m in modes},
        note="bytes are payload bytes rank 0 passed to all_reduce/send/broadcast over the whole run; "
             "comm_share = time inside those calls / forward time (rank 0)",
    )
    path = Path(a.json or Path(__file__).parent / "results" / f"parallel_comm-{a.model}-{a.device}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("identical_to_single", "speedup_vs_single")}, indent=1))
    print({m: {k: round(v, 4) for k, v in med[m].items()} for m in modes})
    return out


if __name__ == "__main__":
    main()
