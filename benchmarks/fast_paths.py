"""The engine's fast paths against its eager path: decode step time and greedy agreement, per batch size.

    python benchmarks/fast_paths.py --device cuda --batches 1 8 32 64 --json out/gpu/fast_paths.json

Three engines on one model and one workload (prompts of --prompt-len tokens, greedy, EOS ignored):
- eager:  `enforce_eager=True`, SDPA over the gathered paged context (what lab 02 teaches);
- flex:   FlexAttention (compiled on CUDA), no graphs;
- graphs: flex for prefill + CUDA-graph replay of decode steps (the default on CUDA).
On a CPU only `eager` and `flex` (uncompiled, its slow reference) run; graphs need CUDA and are reported as
skipped. Prints a short table; --json writes every figure.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from lab_utils import EngineConfig, LLMEngine, SamplingParams, load_model
from lab_utils.device import resolve_device, synchronize


def make_engine(model_tok, device, batch: int, mode: str) -> LLMEngine:
    cfg = EngineConfig(max_num_seqs=batch, enforce_eager=mode == "eager", max_model_len=1024,
                       kv_cache_memory_bytes=512 << 20)
    eng = LLMEngine(model_tok, cfg, device=device)
    if mode == "flex":
        eng.runner.attention_backend, eng.runner.graphs = "flex", None
    return eng


def decode_step_ms(eng: LLMEngine, batch: int, prompt_len: int, steps: int) -> tuple[float, list[list[int]]]:
    """Prefill `batch` prompts, then time `steps` decode steps; returns the median ms and the tokens."""
    ids = [eng.add_request([100 + 7 * i + j for j in range(prompt_len)],
                           SamplingParams(max_tokens=steps + 8, ignore_eos=True)) for i in range(batch)]
    while any(eng.requests[i].is_prefill for i in ids):
        eng.step()
    for _ in range(3):  # warm-up: compilation and graph capture happen here
        eng.step()
    times = []
    for _ in range(steps):
        synchronize(eng.device)
        t = time.perf_counter()
        eng.step()
        synchronize(eng.device)
        times.append(time.perf_counter() - t)
    while eng.has_unfinished():
        eng.step()
    eng.block_manager.check_all_free()
    return 1e3 * statistics.median(times), [eng.requests[i].output_token_ids for i in ids]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    model_tok = load_model(args.model, device=device)
    modes = ["eager", "flex"] + (["graphs"] if device.type == "cuda" else [])
    rows = []
    print(f"{args.model} on {device}; decode step ms (median of {args.steps}); greedy = same tokens as eager")
    print(f"{'batch':>5} " + " ".join(f"{m:>14}" for m in modes) + "  speedup(best)  greedy")
    for b in args.batches:
        row = {"batch": b}
        ref = None
        for m in modes:
            t0 = time.perf_counter()
            eng = make_engine(model_tok, device, b, m)
            ms, toks = decode_step_ms(eng, b, args.prompt_len, args.steps)
            row[m] = {"decode_step_ms": ms, "wall_s": time.perf_counter() - t0,
                      "fell_back": eng.runner.fast_path_error}  # a fast path that failed ran eager: not its time
            if eng.runner.fast_path_error:
                print(f"  {m}: FAILED and fell back to eager: {eng.runner.fast_path_error}", flush=True)
            if ref is None:
                ref = toks
            else:
                row[m]["same_tokens"] = sum(a == c for a, c in zip(ref, toks))
        best = min(modes[1:], key=lambda m: row[m]["decode_step_ms"])
        row["speedup_best"] = row["eager"]["decode_step_ms"] / row[best]["decode_step_ms"]
        agree = " ".join(f"{m}:{row[m]['same_tokens']}/{b}" for m in modes[1:])
        print(f"{b:>5} " + " ".join(f"{row[m]['decode_step_ms']:>11.2f} ms" for m in modes)
              + f"  {row['speedup_best']:>5.2f}x ({best})  {agree}", flush=True)
        rows.append(row)
    if device.type != "cuda":
        print("graphs: skipped (needs CUDA)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "fast_paths", "device": str(device), "model": args.model,
                       "torch": torch.__version__, "platform": platform.platform(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
