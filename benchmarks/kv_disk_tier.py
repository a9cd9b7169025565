"""A returning conversation whose prefix the device pool evicted: recomputed, copied back from the host tier, read
back from the disk tier at admission, or prefetched from disk while other work runs.

    .venv/bin/python benchmarks/kv_disk_tier.py                        # the run in the report
    .venv/bin/python benchmarks/kv_disk_tier.py --prompt-tokens 256 --rounds 1   # a quick look

Workload: conversation A's first turn (`--prompt-tokens` tokens), four other conversations of the same length that
push A's prefix out of a small device pool (and, with the tiers, out of the host tier to disk), then A's second turn (its first turn, the reply, a new message).
The second turn is added while a short request still runs `--gap-steps` decode steps, and held back until that
request ends (the time a queued request waits in a busy server); the clock runs from its admission to its first
token. Configurations (each round runs them all, in a rotated order; the machine is shared):

- `recompute`: no tier: A's prefix is computed again;
- `host`: a host tier that holds A's prefix;
- `disk`: a host tier of one conversation's blocks over a disk tier: the others pushed A's prefix to disk, and
  it is read from there at admission;
- `disk+prefetch`: the same, with the prefetch: A's disk blocks are read into the host tier while the other
  request runs, so they are host hits at admission.

`--disk-mb-per-s` makes each disk read last as long as it would at that bandwidth (a sleep after the read, so
the prefetch thread overlaps it with the steps as a real device's wait would): the tier's file was just written
and sits in the page cache, so without it a "disk" read here is a memory copy.

Reported per configuration: the median admit-to-first-token time, where A's prefix blocks came from (host hits,
of them prefetched, disk hits), the disk tier's read seconds, and whether A's tokens equal recompute's.
Writes benchmarks/results/kv_disk_tier-<date>.json.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_common import machine

from lab_utils import EngineConfig, LLMEngine, SamplingParams, load_model
from lab_utils.engine.kv.disk_tier import DiskTier

CONFIGS = ("recompute", "host", "disk", "disk+prefetch")


def workload(n: int, seed: int = 0) -> tuple[list[int], list[list[int]], list[int]]:
    rng = random.Random(seed)
    tokens = lambda k: [rng.randrange(100, 49_000) for _ in range(k)]  # noqa: E731
    return tokens(n), [tokens(n) for _ in range(4)], tokens(16)


def engine(model, name: str, block_size: int, pool_blocks: int, prompt_blocks: int) -> LLMEngine:
    probe = LLMEngine(model, EngineConfig(block_size=block_size, num_gpu_blocks=4), device="cpu")
    per = probe.bytes_per_block
    host = {"recompute": None, "host": 8 * prompt_blocks * per}.get(name, (prompt_blocks + 2) * per)
    disk = 4 * prompt_blocks * (per + 4096) if name.startswith("disk") else None
    return LLMEngine(model, EngineConfig(block_size=block_size, num_gpu_blocks=pool_blocks, max_num_seqs=4,
                                         max_num_batched_tokens=4096, kv_offload_bytes=host,
                                         kv_offload_disk_bytes=disk, kv_offload_prefetch=name == "disk+prefetch"),
                     device="cpu")


def returning_turn(eng: LLMEngine, first, others, message, gap_steps: int, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outs = [eng.generate([p], params)[0] for p in [first, *others]]
    again = first + outs[0].token_ids + message
    busy = eng.add_request(message, SamplingParams(max_tokens=gap_steps, ignore_eos=True))
    rid = eng.add_request(again, params)
    req = eng.requests[rid]
    eng.scheduler.waiting.remove(req)  # queued behind `busy`: the add-to-admission gap
    while not eng.requests[busy].status.done:
        eng.step()
    eng.scheduler.waiting.append(req)
    t0 = time.perf_counter()
    while req.metrics.first_token_time is None:
        eng.step()
    ttft = time.perf_counter() - t0
    while not req.status.done:
        eng.step()
    s = eng.stats()
    return {"admit_to_first_token_s": ttft, "tokens": req.output_token_ids, "cached_tokens": req.num_cached_tokens,
            "prompt_tokens": len(again), "host_hits": s["host_tier_hits"], "prefetched_hits": s["host_tier_prefetch_hits"],
            "disk_hits": s["disk_tier_hits"], "disk_read_s": s["disk_tier_seconds_in"],
            "disk_bytes_read": s["disk_tier_bytes_in"], "prefetch_wait_s": s["host_tier_prefetch_wait_seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--gap-steps", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--disk-mb-per-s", type=float, default=None,
                    help="make each disk read as slow as this bandwidth (default: as fast as the page cache)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.disk_mb_per_s:
        read = DiskTier.read_claimed

        def slow_read(self, entry):
            t0 = time.perf_counter()
            saved = read(self, entry)
            extra = max(0.0, entry.nbytes / (args.disk_mb_per_s * 1e6) - (time.perf_counter() - t0))
            time.sleep(extra)
            with self._lock:
                self.read_seconds += extra
            return saved

        DiskTier.read_claimed = slow_read
    model = load_model(args.model, device="cpu")
    first, others, message = workload(args.prompt_tokens)
    prompt_blocks = args.prompt_tokens // args.block_size
    pool = prompt_blocks + prompt_blocks // 2 + 8  # one conversation and a half: A's prefix does not survive two
    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    warm = engine(model, "recompute", args.block_size, pool, prompt_blocks)  # kernels and first-call costs
    warm.generate([first], SamplingParams(max_tokens=2))
    warm.close()
    for rnd in range(args.rounds):
        for name in CONFIGS[rnd % len(CONFIGS):] + CONFIGS[:rnd % len(CONFIGS)]:
            eng = engine(model, name, args.block_size, pool, prompt_blocks)
            runs[name].append(returning_turn(eng, first, others, message, args.gap_steps, args.max_tokens))
            eng.close()
            r = runs[name][-1]
            print(f"round {rnd} {name:14s} admit->first token {r['admit_to_first_token_s'] * 1e3:8.1f} ms  cached "
                  f"{r['cached_tokens']:5d}/{r['prompt_tokens']}  host hits {r['host_hits']:3d} (prefetched "
                  f"{r['prefetched_hits']:3d})  disk hits {r['disk_hits']:3d}  disk reads {r['disk_read_s'] * 1e3:.1f} ms",
                  flush=True)
    ref = runs["recompute"][0]["tokens"]
    summary = {name: {"median_admit_to_first_token_s": statistics.median(r["admit_to_first_token_s"] for r in rs),
                      "same_tokens_as_recompute": all(r["tokens"] == ref for r in rs),
                      **{k: rs[-1][k] for k in ("cached_tokens", "prompt_tokens", "host_hits", "prefetched_hits",
                                                  "disk_hits", "disk_bytes_read", "disk_read_s", "prefetch_wait_s")}}
               for name, rs in runs.items()}
    for name, s in summary.items():
        print(f"{name:14s} median {s['median_admit_to_first_token_s'] * 1e3:8.1f} ms  same tokens: "
              f"{s['same_tokens_as_recompute']}")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / \
        f"kv_disk_tier-{datetime.now(timezone.utc):%Y%m%d}.json"
    out.write_text(json.dumps({"args": vars(args), "machine": machine(), "summary": summary, "runs": runs}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
