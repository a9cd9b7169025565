"""The linears of one SmolLM2-135M forward at a few rows: the compiled small-M kernel against oneDNN and MKL.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/small_m_gemm.py                 # rows 1..192
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/small_m_gemm.py --rows 1 4 16 64

What a decode step multiplies: 30 layers' q/k/v (fused, 576 -> 960), o (576 -> 576), gate/up (fused,
576 -> 3072), down (1536 -> 576) and the lm head (576 -> 49152), each layer with its own random weights, so the
540 MB come from memory as in a real step (one layer's weights reused would sit in cache and flatter every
kernel). For each row count: best of 5 passes over all of them with `csrc/small_m_linear.cpp`
(`cpu_kernels().small_m_linear`; its INT8 variant on weight-only INT8 copies, a quarter of the bytes; and its
W8A8 variant on the same INT8 weights with x rounded to INT8 per 32 inputs, byte dot products),
oneDNN's packed GEMM (`torch.ops.mkldnn._linear_pointwise` on weights
reordered once) and MKL (`F.linear`). These figures set `SMALL_M_MAX_ROWS` and `MKL_MIN_ROWS_PER_THREAD` in
`lab_utils/engine/accel/cpu_linear.py`. Writes `benchmarks/results/small_m_gemm-<date>-<threads>threads.json`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_common import machine

from lab_utils.engine.accel.cpu_kernels import cpu_kernels, cpu_kernels_status
from lab_utils.quant.linear import Int8Linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one layer's linears
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def _linear(w: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w
    return lin


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 96, 128, 192])
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    kernels = cpu_kernels()
    if kernels is None:
        print(f"skipped: {cpu_kernels_status()}")
        return 0
    torch.manual_seed(0)
    weights = [[torch.randn(n, k) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    weights.append([torch.randn(VOCAB, HIDDEN) * 0.02])
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w) for w in layer] for layer in weights]
    int8 = [[Int8Linear.from_linear(_linear(w)) for w in layer] for layer in weights]  # weight-only INT8 copies
    nbytes = 4 * sum(w.numel() for layer in weights for w in layer)

    def best(fn, rows: int) -> float:
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        times = []
        for _ in range(args.passes):
            t = time.perf_counter()
            for li, layer in enumerate(weights):
                for wi, w in enumerate(layer):
                    fn(xs[w.shape[1]], w, (packed[li][wi], int8[li][wi]))
            times.append(time.perf_counter() - t)
        return min(times)

    paths = {
        "small_m": lambda x, w, p: kernels.small_m_linear(x, [w]),
        "onednn": lambda x, w, p: torch.ops.mkldnn._linear_pointwise(x, p[0], None, "none", [], ""),
        "mkl": lambda x, w, p: F.linear(x, w),
        "small_m_int8": lambda x, w, p: kernels.small_m_linear_int8(x, [p[1].qweight], p[1].scale),
        "small_m_w8a8": lambda x, w, p: kernels.small_m_linear_w8a8(x, [p[1].qweight], p[1].scale),
    }
    rows_out = []
    for rows in args.rows:
        ms = {name: 1e3 * best(fn, rows) for name, fn in paths.items()}
        row = {"rows": rows, **{f"{n}_ms": round(v, 2) for n, v in ms.items()},
               "small_m_GBps": round(nbytes / ms["small_m"] / 1e6, 1),
               "small_m_GFLOPs": round(2 * rows * nbytes / 4 / ms["small_m"] / 1e6, 1),
               "onednn_over_small_m": round(ms["onednn"] / ms["small_m"], 3)}
        rows_out.append(row)
        print(f"rows {rows:4d}: small-M {ms['small_m']:7.1f} ms ({row['small_m_GBps']:5.1f} GB/s, "
              f"{row['small_m_GFLOPs']:6.1f} GFLOP/s)  oneDNN {ms['onednn']:7.1f}  MKL {ms['mkl']:7.1f}  "
              f"oneDNN / small-M {row['onednn_over_small_m']:.2f}  INT8 small-M {ms['small_m_int8']:7.1f}  "
              f"W8A8 small-M {ms['small_m_w8a8']:7.1f}", flush=True)
    date = datetime.now(timezone.utc)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"small_m_gemm-{date:%Y%m%d}-{threads}threads.json")
    out.write_text(json.dumps({"benchmark": "small_m_gemm", "date": f"{date:%Y-%m-%d %H:%M} UTC",
                               "command": " ".join([f"OMP_NUM_THREADS={threads}", "python", *sys.argv]),
                               "machine": machine(), "weights_MB": round(nbytes / 1e6, 1),
                               "results": rows_out}, indent=1))
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
