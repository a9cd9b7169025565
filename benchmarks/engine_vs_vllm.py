"""The lab engine against real vLLM on SmolLM2-135M: same seeded workload, same settings, same process.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engine_vs_vllm.py                # 64 prompts, 3 repeats
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engine_vs_vllm.py --num-prompts 32 --repeats 1 --profile

Both engines get the same token ids (a seeded workload of Shakespeare prompts with mixed input and output
lengths, saved with its SHA-256), greedy with EOS ignored, the same `max_num_seqs`, token budget, block size
and KV budget, fp32, eager, one process. The order alternates each repeat (lab first, then vLLM first, ...),
so drift in the machine's load hits both; the report gives per-run figures, medians and the ratio
lab ÷ vLLM. `--profile` adds a cProfile of the lab engine's `step()` (where its time goes).
Writes `benchmarks/results/engine_vs_vllm-<date>.json`.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lab_utils import vllm_env  # noqa: E402

vllm_env.setup()

from bench_common import KEYS, machine  # noqa: E402  (shared with engine_vs_hf.py)


def versions() -> dict:
    import torch
    import transformers
    import vllm

    return {"torch": torch.__version__, "transformers": transformers.__version__, "vllm": vllm.__version__}


def profile_lab(backend, workload, top: int = 25) -> dict:
    """cProfile one lab run; the top functions by own time and the share spent in the model's forward."""
    prof = cProfile.Profile()
    prof.enable()
    run = backend.run(workload, warmup=False)
    prof.disable()
    st = pstats.Stats(prof)
    total = st.total_tt
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append({"function": f"{Path(file).name}:{line}({fn})", "calls": nc, "tottime_s": tt, "cumtime_s": ct})
    by_tot = sorted(rows, key=lambda r: -r["tottime_s"])[:top]
    by_cum = sorted(rows, key=lambda r: -r["cumtime_s"])

    def cum(name: str) -> float:
        return max((r["cumtime_s"] for r in rows if name in r["function"]), default=0.0)

    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return {"total_s": total, "run_duration_s": run.duration,
            "share": {k: cum(v) / total for k, v in {
                "engine.step": "(step)", "model_runner.run": "model_runner.py", "model forward (hidden_states)":
                "(hidden_states)", "paged attention": "attention.py", "scheduler.schedule": "(schedule)",
                "sampler": "sampler.py", "lm head (logits)": "(logits)"}.items()},
            "top_by_tottime": by_tot, "top_by_cumtime": by_cum[:top], "text": buf.getvalue()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64, help="mean prompt tokens (uniform ±50%%)")
    ap.add_argument("--output-len", type=int, default=64, help="mean output tokens (uniform ±50%%)")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=32, help="vLLM's CPU kernels need a multiple of 32")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=vllm_env.DEFAULT_CPU_KV_BYTES)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="also cProfile one lab run")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/engine_vs_vllm-<date>.json)")
    args = ap.parse_args(argv)

    import torch

    from lab_utils import EngineConfig
    from lab_utils.bench.backends import LabBackend
    from lab_utils.bench.backends_vllm import VLLMBackend
    from lab_utils.bench.workload import make_workload
    from lab_utils.models.loader import model_folder
    from lab_utils.models.tokenizer import load_tokenizer

    ok, why = vllm_env.available()
    if not ok:
        print(f"engine_vs_vllm: {why}", file=sys.stderr)
        return 2
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # before vLLM pins torch's setter
    tok = load_tokenizer(model_folder("smollm2-135m"))
    wl = make_workload(tok, args.num_prompts, args.input_len, args.output_len, length_dist="uniform",
                       input_dist="uniform", seed=args.seed, tokenizer_name="smollm2-135m")
    cfg = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                       enable_prefix_caching=True, enable_chunked_prefill=True, enforce_eager=True,
                       max_model_len=2048)
    print(f"workload: {len(wl)} prompts, input {min(wl.input_lens)}..{max(wl.input_lens)}, output "
          f"{min(wl.output_lens)}..{max(wl.output_lens)} tokens ({sum(wl.output_lens)} total), sha256 "
          f"{wl.content_hash[:12]}", flush=True)
    t = time.perf_counter()
    backends = {"lab": LabBackend("smollm2-135m", cfg, device="cpu", dtype=torch.float32)}
    t_lab = time.perf_counter() - t
    t = time.perf_counter()
    backends["vllm"] = VLLMBackend("smollm2-135m", cfg, device="cpu", enforce_eager=True)
    t_vllm = time.perf_counter() - t
    print(f"start-up: lab {t_lab:.1f} s, vLLM {t_vllm:.1f} s", flush=True)
    for b in backends.values():  # one untimed pass each: first calls pay for lazy initialisation
        b.run(wl.head(2), warmup=True)

    runs = {"lab": [], "vllm": []}
    outputs = {}
    for rep in range(args.repeats):
        order = ["lab", "vllm"] if rep % 2 == 0 else ["vllm", "lab"]
        for name in order:
            run = backends[name].run(wl, warmup=False)
            s = run.summary(workload=wl)
            if s["errors"] or s["completed"] != len(wl):
                raise RuntimeError(f"{name} run {rep}: {s['completed']}/{len(wl)} completed, errors {s['errors'][:3]}")
            row = {k: s[k] for k in KEYS}
            row.update(repeat=rep, position=order.index(name), load_avg_1m=os.getloadavg()[0],
                       engine_stats=s.get("engine_stats"))
            runs[name].append(row)
            outputs[name] = run.outputs()
            print(f"repeat {rep} {name:4s}: {row['output_throughput']:7.1f} out tok/s, median TTFT "
                  f"{row['median_ttft_ms']:8.1f} ms, median TPOT {row['median_tpot_ms']:7.1f} ms "
                  f"(load {row['load_avg_1m']:.1f})", flush=True)

    same = sum(outputs["lab"][k] == outputs["vllm"][k] for k in outputs["lab"])
    med = {n: {k: statistics.median(r[k] for r in rs) for k in KEYS} for n, rs in runs.items()}
    ratio = {k: med["lab"][k] / med["vllm"][k] for k in KEYS if med["vllm"][k]}
    result = {
        "benchmark": "engine_vs_vllm", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "model": "smollm2-135m", "machine": machine(), "versions": versions(),
        "workload": dict(wl.meta, sha256=wl.content_hash, total_output_tokens=sum(wl.output_lens)),
        "config": {"lab": backends["lab"].describe(), "vllm": backends["vllm"].describe()},
        "startup_s": {"lab": t_lab, "vllm": t_vllm},
        "runs": runs, "median": med, "ratio_lab_over_vllm": ratio,
        "identical_greedy_outputs": f"{same}/{len(wl)}",
    }
    print(f"\nmedians over {args.repeats} repeats (lab / vLLM / ratio):")
    for k in KEYS:
        print(f"  {k:20s} {med['lab'][k]:10.2f} {med['vllm'][k]:10.2f} {ratio.get(k, float('nan')):7.2f}")
    print(f"identical greedy outputs: {same}/{len(wl)}")
    if args.profile:
        prof = profile_lab(backends["lab"], wl)
        result["lab_profile"] = {k: v for k, v in prof.items() if k != "text"}
        print("\nlab engine profile (share of run time, cumulative):")
        for k, v in prof["share"].items():
            print(f"  {k:32s} {v:6.1%}")
        print(prof["text"][:4000])
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / \
        f"engine_vs_vllm-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    for b in backends.values():
        b.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
