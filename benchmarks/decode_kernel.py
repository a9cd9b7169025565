"""Lab 16's Triton decode kernel against the KV-bytes bound, FlexAttention and SDPA over a dense copy; split-KV's
gain at batch 1 and long context.

    python benchmarks/decode_kernel.py --json benchmarks/results/decode_kernel-<date>.json          # on a GPU
    python benchmarks/decode_kernel.py --quick                                       # CPU: the interpreter, tiny

Goals (on a GPU, bf16, SmolLM2-135M's heads: 9 query heads on 3 KV heads of dim 64, block size 16):
- the reference kernel (`lab_utils/kernels/paged_decode_triton.py`) at >= 70 % of the KV-bytes bound at batch 64,
  context 4k, and at least as fast as the engine's FlexAttention there;
- split-KV >= 2x the single-program kernel at batch 1, context 32k.
The bound is the time to read the point's K/V at the read bandwidth measured on a tensor of the same size
(`decode_bench.read_bandwidth`). On a CPU the kernels run under Triton's interpreter: the figures describe the
interpreter and the goals are not judged.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch
from bench_common import machine

from lab_utils.kernels import decode_bench, triton_env

GOAL_FRACTION, GOAL_SPLIT_GAIN = 0.70, 2.0


def run(quick: bool, num_splits: int, repeats: int) -> dict:
    triton, how = triton_env.load()
    if triton is None:
        raise SystemExit(how)
    from lab_utils.kernels.paged_decode_triton import paged_decode, paged_decode_split
    from lab_utils.threads import fit_threads

    fit_threads()  # PyTorch's CPU threads: the cores idle now (as the lab does)

    device = torch.device(triton_env.device())
    gpu = device.type == "cuda"
    dtype, block = ("bfloat16", 16) if gpu else ("float32", 64)
    point = (2, 128) if quick else (64, 4096)
    long = (1, 512) if quick else (1, 32768)
    shape = lambda b, c: decode_bench.DecodeShape(b, c, 9, 3, 64, block, dtype)
    engine = "flex" if gpu else "sdpa"
    paths = {"reference_kernel": lambda c: decode_bench.kernel_call(paged_decode, c),
             f"engine_{engine}": lambda c: decode_bench.engine_call(c, engine),
             "sdpa_dense": decode_bench.sdpa_dense_call}
    at_point = decode_bench.measure(paths, shape(*point), device, repeats)
    single, split = decode_bench.measure(
        {"single": lambda c: decode_bench.kernel_call(paged_decode, c),
         "split": lambda c: decode_bench.kernel_call(paged_decode_split, c, num_splits)},
        shape(*long), device, repeats)
    rows = [{"path": t.path, "batch": t.shape.batch, "context": t.shape.context, "us": round(t.us, 2),
             "bound_us": round(t.bound_us, 3), "fraction_of_bound": float(f"{t.fraction:.4g}")}
            for t in at_point + [single, split]]
    ref, flex = at_point[0], at_point[1]
    gain = single.us / split.us
    goals = None
    if gpu:
        goals = {"reference_fraction_ge_0.70": ref.fraction >= GOAL_FRACTION,
                 "reference_not_slower_than_flex": ref.us <= flex.us,
                 "split_gain_ge_2x": gain >= GOAL_SPLIT_GAIN}
    return {"device": device.type, "triton": how, "dtype": dtype, "block_size": block, "num_splits": num_splits,
            "gpu_name": torch.cuda.get_device_name(device) if gpu else None, "rows": rows,
            "split_gain": round(gain, 3), "goals": goals,
            "goals_note": None if gpu else "not judged: on a CPU the kernels run under Triton's interpreter"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (a CPU under the interpreter, or a smoke run)")
    p.add_argument("--num-splits", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    out = {"benchmark": "decode_kernel", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": machine(), **run(args.quick, args.num_splits, args.repeats)}
    for r in out["rows"]:
        print(f"{r['path']:18s} batch {r['batch']:4d} context {r['context']:6d}: {r['us']:12.1f} µs, "
              f"{r['fraction_of_bound']:.4f} of the KV-bytes bound ({r['bound_us']:.1f} µs)")
    print(f"split-KV gain at batch 1: {out['split_gain']:.2f}x; goals: {out['goals'] or out['goals_note']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0 if out["goals"] is None or all(out["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
