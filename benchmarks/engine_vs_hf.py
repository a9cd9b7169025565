"""The lab engine against Hugging Face-style `generate` with static batches (the baseline a newcomer writes).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engine_vs_hf.py                       # lab 01's workload
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engine_vs_hf.py --batch-sizes 16 --repeats 1

Both get the same saved, seeded workload (lab 01's: 128 requests, long-tailed output lengths, greedy, EOS
ignored), the same model weights and dtype, in one process. The baseline pads each batch of `batch_size`
requests and runs it to its longest member; the engine runs continuous batching with `max_num_seqs` equal to
that batch size. Every size in `--batch-sizes` is run for both, the order alternating each repeat; the report
gives the ratio at equal batch size and the engine's best against the baseline's best (each at its own best
batch size), medians over repeats. Writes `benchmarks/results/engine_vs_hf-<date>.json`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_common import KEYS, machine  # noqa: E402  (same machine record and metric names as engine_vs_vllm)

WORKLOAD = ROOT / "benchmarks" / "results" / "lab01_workload.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default=str(WORKLOAD), help="a saved workload (JSON)")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[16, 32, 64, 128])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/engine_vs_hf-<date>.json)")
    args = ap.parse_args(argv)

    import torch
    import transformers

    from lab_utils import EngineConfig
    from lab_utils.bench.backends import HFBackend, LabBackend, load_hf_model
    from lab_utils.bench.workload import Workload
    from lab_utils.models.loader import load_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    wl = Workload.load(args.workload)
    model, tok = load_model("smollm2-135m", device="cpu", dtype=torch.float32)  # the engine's
    hf_model = load_hf_model("smollm2-135m", torch.device("cpu"), torch.float32)  # transformers' own Llama
    backends = {}
    for b in args.batch_sizes:
        backends[f"hf b={b}"] = HFBackend("smollm2-135m", batch_size=b, device="cpu", hf_model=hf_model, tokenizer=tok)
        cfg = EngineConfig(max_num_seqs=b, max_num_batched_tokens=512, block_size=16)
        backends[f"lab b={b}"] = LabBackend((model, tok), cfg, device="cpu", dtype=torch.float32)
    print(f"workload: {len(wl)} requests, {sum(wl.output_lens)} output tokens, sha256 {wl.content_hash[:12]}",
          flush=True)
    for b in backends.values():  # untimed: lazy initialisation
        b.run(wl.head(2), warmup=True)

    runs: dict[str, list[dict]] = {n: [] for n in backends}
    outputs = {}
    for rep in range(args.repeats):
        order = list(backends) if rep % 2 == 0 else list(reversed(backends))
        for name in order:
            t = time.perf_counter()
            run = backends[name].run(wl, warmup=False)
            s = run.summary(workload=wl)
            if s["errors"] or s["completed"] != len(wl):
                raise RuntimeError(f"{name} run {rep}: {s['completed']}/{len(wl)} completed, errors {s['errors'][:3]}")
            row = {k: s[k] for k in KEYS}
            row.update(repeat=rep, wall_s=time.perf_counter() - t, load_avg_1m=os.getloadavg()[0])
            runs[name].append(row)
            outputs[name] = run.outputs()
            print(f"repeat {rep} {name:9s}: {row['output_throughput']:7.1f} out tok/s, median TPOT "
                  f"{row['median_tpot_ms']:7.1f} ms (load {row['load_avg_1m']:.1f})", flush=True)

    med = {n: {k: statistics.median(r[k] for r in rs) for k in KEYS} for n, rs in runs.items()}
    tput = {n: m["output_throughput"] for n, m in med.items()}
    equal = {b: tput[f"lab b={b}"] / tput[f"hf b={b}"] for b in args.batch_sizes}
    best_lab = max((n for n in tput if n.startswith("lab")), key=tput.get)
    best_hf = max((n for n in tput if n.startswith("hf")), key=tput.get)
    ref = outputs[f"hf b={args.batch_sizes[0]}"]
    same = {n: sum(o[k] == ref[k] for k in ref) for n, o in outputs.items()}
    result = {
        "benchmark": "engine_vs_hf", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "model": "smollm2-135m", "machine": machine(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "workload": dict(wl.meta, path=args.workload, sha256=wl.content_hash, total_output_tokens=sum(wl.output_lens)),
        "config": {n: b.describe() for n, b in backends.items()},
        "runs": runs, "median": med,
        "ratio_lab_over_hf_equal_batch": equal,
        "best": {"lab": best_lab, "hf": best_hf, "ratio": tput[best_lab] / tput[best_hf]},
        "greedy_outputs_identical_to_hf": {n: f"{v}/{len(ref)}" for n, v in same.items()},
    }
    print("\nmedian output throughput (tok/s):")
    for n, v in tput.items():
        print(f"  {n:9s} {v:8.1f}")
    for b, r in equal.items():
        print(f"lab ÷ hf at batch {b}: {r:.2f}x")
    print(f"best lab ({best_lab}) ÷ best hf ({best_hf}): {result['best']['ratio']:.2f}x")
    print("greedy outputs equal to HF's:", result["greedy_outputs_identical_to_hf"])
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / \
        f"engine_vs_hf-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
