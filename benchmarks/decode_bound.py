"""Decode step time vs the memory-bandwidth bound, and batched throughput, on whatever device is present.

    python benchmarks/decode_bound.py --device cuda --models smollm2-135m llama-3.2-1b-random --json out.json

Bound for one decode step = (bytes of weights + bytes of KV read) / measured copy bandwidth: a decode step must
read every weight once, so no engine can beat it. Reports achieved / bound (the goal on a GPU: >= 60% at batch 1).
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch

from lab_utils import EngineConfig, LLMEngine, SamplingParams, load_model
from lab_utils.device import resolve_device, synchronize, time_fn


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), median of 5 after warm-up."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    t = time_fn(lambda: b.copy_(a), device=device, warmup=2, repeat=5)
    return 2 * nbytes / t.median


def decode_step_time(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> float:
    rng = random.Random(0)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, 40000) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        synchronize(engine.device)
        t0 = time.perf_counter()
        engine.step()
        synchronize(engine.device)
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64, 128, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dev = resolve_device(a.device)
    bw = copy_bandwidth(dev, (1 << 30) if dev.type == "cuda" else (256 << 20))
    result = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "copy_bandwidth_GBps": bw / 1e9, "date": time.strftime("%Y-%m-%d"), "rows": []}
    print(f"device {result['device']}: measured copy bandwidth {bw / 1e9:.1f} GB/s")
    print(f"{'model':24s} {'batch':>5s} {'step ms':>9s} {'bound ms':>9s} {'achieved/bound':>14s} {'tok/s':>9s}")
    for name in a.models:
        model, tok = load_model(name, device=dev)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        for batch in a.batches:
            eng = LLMEngine((model, tok), EngineConfig(max_num_seqs=max(batch, 1), max_num_batched_tokens=max(512, batch * 2),
                                                      kv_cache_memory_bytes=None if dev.type == "cuda" else 1 << 30),
                            device=dev)
            step = decode_step_time(eng, batch, a.prompt_len, a.steps)
            kv_bytes = batch * (a.prompt_len + 8) * eng.bytes_per_token
            bound = (weight_bytes + kv_bytes) / bw
            row = {"model": name, "batch": batch, "step_ms": step * 1e3, "bound_ms": bound * 1e3,
                   "achieved_over_bound": bound / step, "tokens_per_s": batch / step,
                   "weight_bytes": weight_bytes, "kv_bytes": kv_bytes}
            result["rows"].append(row)
            print(f"{name:24s} {batch:5d} {step * 1e3:9.2f} {bound * 1e3:9.2f} {bound / step:14.2f} {batch / step:9.0f}")
            del eng
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        del model
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
