"""Host work of one engine step, the model forward stubbed: time and counts per step at batch 1, 64 and 256.

    python benchmarks/step_overhead.py --json benchmarks/results/step_overhead-YYYYMMDD.json [--device cuda]

A GPU step is only as fast as the host that lays it out. This runs the engine's real `LLMEngine.step` with the
model's forward and lm head replaced by stand-ins (`lab_utils.bench.step_counts.stub_forward`), so what is left is
the host side: scheduling, metadata, copies, sampling bookkeeping, outputs. Rows: decode steady state at each
batch, and one row per batch with arrivals (a request leaves and a new prompt joins every step).
Per row: host us/step (median), tensors made from host data per step (`torch.tensor` of a list, `torch.from_numpy`:
each a host buffer and a copy; `list_tensors_per_step`) and device syncs per step (`HostCounter`). `goals` holds
issue 49's CPU goals against the run.
On a CPU the engine takes CUDA's code path (`cuda_logic_engine`); with --device cuda the engine as built there.
Plus the dispatcher (aten) calls per decoder layer of one real decode step on CUDA's code path, run on the CPU
(`aten_calls_per_decode_layer`), with the real forward.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_common import machine

from lab_utils import EngineConfig, LLMEngine
from lab_utils.bench.step_counts import (
    aten_calls_per_decode_layer,
    cuda_logic_engine,
    measure_host_steps,
)
from lab_utils.models.loader import load_model


def engine_for(model_tok, device: str, batch: int, prompt_len: int, steps: int):
    blocks = batch * (-(-(prompt_len + steps + 40) // 16)) + 64
    if device == "cpu":
        return cuda_logic_engine(model_tok, batch, blocks)
    cfg = EngineConfig(max_num_seqs=batch, num_gpu_blocks=blocks, max_num_batched_tokens=max(512, 2 * batch))
    return LLMEngine(model_tok, cfg, device=device)


GOALS = {"host_us_per_step_decode_batch256": 400, "list_tensors_per_step": 2, "syncs_per_step": 1,
         "aten_calls_per_decode_layer": 20}


def goals(rows: list[dict], counts: dict) -> dict:
    """Issue 49's CPU goals against this run: the worst value over the rows each goal covers."""
    decode256 = [r["host_us_per_step"] for r in rows if r["batch"] == 256 and not r["arrivals"]]
    values = {"host_us_per_step_decode_batch256": max(decode256) if decode256 else None,
              "list_tensors_per_step": max(r["list_tensors_per_step"] for r in rows),
              "syncs_per_step": max(r["syncs_per_step"] for r in rows),
              "aten_calls_per_decode_layer": counts["aten_calls_per_decode_layer"]}
    return {k: {"value": v, "limit": GOALS[k], "met": v is not None and v <= GOALS[k]} for k, v in values.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="where to write the figures")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="tiny-random", help="its shape does not matter with the forward stubbed")
    ap.add_argument("--count-model", default="smollm2-135m-random", help="the model whose layers are counted")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads: the host side's tensors are tiny, and OpenMP threads on a busy "
                         "machine only wait for each other")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    model_tok = load_model(args.model, device=args.device, dtype=torch.float32)
    rows = []
    for b in args.batches:
        for arrivals in (False, True):
            eng = engine_for(model_tok, args.device, b, args.prompt_len, args.steps)
            row = measure_host_steps(eng, b, args.prompt_len, args.steps, arrivals)
            eng.close()
            print(f"batch={b:4d} arrivals={arrivals!s:5} host_us_per_step={row['host_us_per_step']:9.1f} "
                  f"list_tensors={row['list_tensors_per_step']:.2f} syncs={row['syncs_per_step']:.2f}", flush=True)
            rows.append(row)
    count_model = load_model(args.count_model, device="cpu", dtype=torch.bfloat16)
    eng = cuda_logic_engine(count_model, 4, 128)
    counts = aten_calls_per_decode_layer(eng)
    eng.close()
    print(f"aten calls per decode layer (CUDA code path, {args.count_model}): {counts['aten_calls_per_decode_layer']}")
    out = {"device": args.device, "machine": machine(), "torch_threads": args.threads, "model": args.model,
           "count_model": args.count_model, "prompt_len": args.prompt_len, "rows": rows, **counts,
           "goals": goals(rows, counts), "load_avg_1m_end": os.getloadavg()[0]}
    for name, g in out["goals"].items():
        print(f"goal {name}: {g['value']} (limit {g['limit']}) {'met' if g['met'] else 'NOT MET'}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
