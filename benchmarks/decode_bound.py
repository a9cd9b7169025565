"""Decode step time vs the memory-bandwidth bound, and batched throughput, on whatever device is present.

    python benchmarks/decode_bound.py --device cuda --models smollm2-135m llama-3.2-1b-random --json out.json

Bound for one decode step = (bytes of weights + bytes of KV read) / measured copy bandwidth: a decode step must
read every weight once, so no engine can beat it. Reports achieved / bound (the goal on a GPU: >= 60% at batch 1).
Each engine is warmed up (compiled, graphs captured) before its timed window, every timed step holds the whole
batch (`lab_utils.bench.decode_window`), and tokens/s is sum(rows) / sum(time). On CUDA the graph replay alone
is timed too (CUDA events), beside the whole step.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import time

import torch

from lab_utils import EngineConfig, LLMEngine, load_model
from lab_utils.bench.decode_window import decode_window, window_tokens
from lab_utils.device import resolve_device, time_fn


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), median of 5 after warm-up."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    return 2 * nbytes / time_fn(lambda: b.copy_(a), device=device, warmup=2, repeat=5).median


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64, 128, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kv-gib", type=float, default=None, help="KV cache per engine (default: 16 on CUDA, 1 on CPU)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dev = resolve_device(a.device)
    kv_bytes = int((a.kv_gib or (16 if dev.type == "cuda" else 1)) * 2**30)
    bw = copy_bandwidth(dev, (1 << 30) if dev.type == "cuda" else (256 << 20))
    result = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "copy_bandwidth_GBps": bw / 1e9, "date": time.strftime("%Y-%m-%d"), "rows": []}
    print(f"device {result['device']}: measured copy bandwidth {bw / 1e9:.1f} GB/s")
    print(f"{'model':24s} {'batch':>5s} {'step ms':>9s} {'replay ms':>9s} {'bound ms':>9s} {'achieved/bound':>14s} "
          f"{'tok/s':>9s}")
    for name in a.models:
        model, tok = load_model(name, device=dev)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        for batch in a.batches:
            budget = max(512, batch * 2)
            eng = LLMEngine((model, tok), EngineConfig(max_num_seqs=max(batch, 1), max_num_batched_tokens=budget,
                                                      kv_cache_memory_bytes=kv_bytes), device=dev)
            eng.warmup(max_batch=batch, max_context=a.prompt_len + window_tokens(budget, batch, a.prompt_len, a.steps))
            w = decode_window(eng, batch, a.prompt_len, a.steps)
            kv = batch * w["mean_context"] * eng.bytes_per_token
            bound = (weight_bytes + kv) / bw
            row = {"model": name, "batch": batch, "step_ms": w["step_s"] * 1e3, "bound_ms": bound * 1e3,
                   "achieved_over_bound": bound / w["step_s"], "tokens_per_s": w["tokens_per_s"],
                   "weight_bytes": weight_bytes, "kv_bytes": kv, "rows_per_step": sorted(set(w["rows"])),
                   "replay_ms": None if w["replay_s"] is None else w["replay_s"] * 1e3,
                   "fast_path_errors": dict(eng.runner.fast_path_errors)}
            result["rows"].append(row)
            replay = "-" if w["replay_s"] is None else f"{w['replay_s'] * 1e3:.2f}"
            print(f"{name:24s} {batch:5d} {w['step_s'] * 1e3:9.2f} {replay:>9s} {bound * 1e3:9.2f} "
                  f"{bound / w['step_s']:14.2f} {w['tokens_per_s']:9.0f}")
            eng.close()
            del eng
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            if a.json:  # after every row: a run cut short keeps what it measured
                with open(a.json, "w") as f:
                    json.dump(result, f, indent=2)
        del model
    return result


if __name__ == "__main__":
    main()
