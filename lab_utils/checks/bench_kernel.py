"""`python -m lab_utils bench-kernel`: check and time the learner's saved decode kernel for the room's leaderboard.

The kernel is `my_engine/kernel.py` (saved by lab 16's checks). It runs in a separate process, never in the
learner's own Python: a kernel that crashes, hangs or leaks cannot take the notebook down, and the result is the
file's, not a cell's. The worker checks it against `paged_attention_reference` on the lab's random cases, then
times it on one decode shape; the parent prints one JSON line and appends it to `.kernel_bench.jsonl` beside
`my_engine/`, where the workshop board (`lab_utils/workshop/board.py`) ranks the room's lines.
"""
from __future__ import annotations

import argparse
import getpass
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS_NAME = ".kernel_bench.jsonl"
PARTS = ("kernel.paged_decode", "kernel.paged_decode_split")


def default_dir() -> Path:
    """The learner's my_engine/: `LAB_LEARNER_DIR`, else ./my_engine, student/my_engine or labs/my_engine,
    whichever holds a kernel.py first."""
    from lab_utils.course.learner_parts import learner_dir

    here = learner_dir()
    for cand in (here, Path("student") / "my_engine", Path("labs") / "my_engine"):
        if (cand / "kernel.py").exists():
            return cand
    return here


def worker(cfg: dict) -> dict:
    """In the child: load the saved part, check it, time it. Returns the result (never raises for the kernel's
    faults: a wrong or failing kernel is a line with correct false and the reason)."""
    from lab_utils.checks import lab16
    from lab_utils.course import learner_parts
    from lab_utils.kernels import decode_bench, triton_env

    triton, how = triton_env.load()
    out = {"part": cfg["part"], "device": triton_env.device(), "triton": how, "correct": False,
           "us_per_call": None, "bound_us": None, "fraction_of_bound": None, "shape": cfg["shape"], "error": None}
    if triton is None:
        return {**out, "error": how}
    saved = learner_parts._load_saved("kernel")
    fn = saved.get(cfg["part"])
    if fn is None:
        path = Path(os.environ["LAB_LEARNER_DIR"]) / "kernel.py"
        return {**out, "error": f"no {cfg['part']} in {path}: pass lab 16's check for it first (it saves the file)"}
    splits = cfg.get("num_splits")
    try:
        lab16._check_outputs(cfg["part"], fn, cfg["cases"], cfg["seed"], (None,) if splits is None else (splits,))
    except Exception as err:  # a wrong answer or a crash: the line says which, the room's board shows it
        return {**out, "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:400]}
    import torch

    device = torch.device(out["device"])
    shape = decode_bench.DecodeShape(**cfg["shape"])
    make = (lambda c: decode_bench.kernel_call(fn, c)) if splits is None else \
        (lambda c: decode_bench.kernel_call(fn, c, splits))
    (timing,) = decode_bench.measure({"yours": make}, shape, device, repeats=cfg["repeats"], seed=cfg["seed"])
    return {**out, "correct": True, "us_per_call": round(timing.us, 2), "bound_us": round(timing.bound_us, 3),
            "fraction_of_bound": float(f"{timing.fraction:.4g}")}


def run(folder: Path, part: str = "kernel.paged_decode", shape: dict | None = None, num_splits: int | None = None,
        cases: int = 6, seed: int = 0, repeats: int = 3, timeout_s: float = 600, name: str | None = None,
        out: Path | None = None) -> dict:
    """Check and time `folder`/kernel.py's `part` in a child process; the result line (also appended to `out`,
    default `.kernel_bench.jsonl` beside the folder)."""
    if part not in PARTS:
        raise ValueError(f"part {part!r} is not a kernel part: choose one of {PARTS}")
    if (num_splits is None) != (part == "kernel.paged_decode"):
        raise ValueError("--num-splits goes with kernel.paged_decode_split (and only with it)")
    from lab_utils.kernels.decode_bench import DecodeShape

    shape = DecodeShape(**(shape or {"batch": 4, "context": 256, "block_size": 64})).as_dict()  # bad sizes: here
    folder = Path(folder).resolve()
    cfg = {"part": part, "shape": shape, "num_splits": num_splits,
           "cases": cases, "seed": seed, "repeats": repeats}
    env = {**os.environ, "LAB_LEARNER_DIR": str(folder), "LAB_CHECKS_LOG": "off"}
    line = {"name": name or os.environ.get("JUPYTERHUB_USER") or getpass.getuser(), "time": round(time.time(), 1)}
    try:
        proc = subprocess.run([sys.executable, "-m", "lab_utils.checks.bench_kernel", "--worker", json.dumps(cfg)],
                              env=env, capture_output=True, text=True, timeout=timeout_s)
        result = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {
            "part": part, "correct": False, "error": f"the worker exited {proc.returncode}: "
                                                     f"{(proc.stderr.strip().splitlines() or [''])[-1][:400]}"}
    except subprocess.TimeoutExpired:
        result = {"part": part, "correct": False, "error": f"no result within {timeout_s:.0f} s (a kernel that "
                                                           f"never ends?)"}
    line.update(result)
    path = Path(out) if out is not None else folder.parent / RESULTS_NAME
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
    return line


def _main(args: argparse.Namespace) -> int:
    folder = Path(args.dir) if args.dir else default_dir()
    shape = {"batch": args.batch, "context": args.context, "block_size": args.block_size, "q_heads": args.q_heads,
             "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": args.dtype}
    line = run(folder, args.part, shape, args.num_splits, args.cases, args.seed, args.repeats, args.timeout,
               args.name, Path(args.out) if args.out else None)
    print(json.dumps(line))
    return 0 if line["correct"] else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("bench-kernel", help="check and time your saved lab 16 kernel (one JSON line)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="your my_engine/ folder (default: LAB_LEARNER_DIR, ./my_engine, student/my_engine "
                                 "or labs/my_engine, the first with a kernel.py)")
    p.add_argument("--part", default="kernel.paged_decode", choices=PARTS)
    p.add_argument("--num-splits", type=int, help="for kernel.paged_decode_split")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--cases", type=int, default=6, help="random correctness cases before timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600, help="seconds before the worker is stopped")
    p.add_argument("--name", help="your name on the board's line (default: JUPYTERHUB_USER or the login)")
    p.add_argument("--out", help=f"JSON-lines file to append to (default: {RESULTS_NAME} beside my_engine/)")
    p.set_defaults(func=_main)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    print(json.dumps(worker(json.loads(sys.argv[2]))))
