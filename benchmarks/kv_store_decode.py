"""The prefill -> decode hand-off through the shared KV store vs on the pipe, on lab 10's workload.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kv_store_decode.py                 # lab 10's demo prompts
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kv_store_decode.py --chars 2000    # longer prompts

Two `DisaggregatedCluster`s (a prefill and a decode worker each, one thread per worker) serve the same prompts:
one hands each prompt's KV over on the pipe between its workers (`kv_transfer="pipe"`, lab 10), the other puts
the prompt's full blocks in a KV store process and sends only the header and the partial last block on the pipe
(`kv_transfer="store"`). Both run every round, alternating which goes first (the machine is shared). Lab 10's
workload: Shakespeare passages of `--chars` characters (160 in the lab), `--tokens` greedy tokens each (24),
arriving 0.3 s apart, new passages each round; with `--shared-prefix`, each prompt starts with the same
instruction, so the store holds those blocks after the first request and the prefill side puts only the new ones.
Reported per path, over all rounds: bytes on the pipe, bytes put into and got from the store, blocks, seconds per
hand-off (mean over requests: export + store puts + pipe write + pipe read + store gets + unpack), requests
recomputed (none unless the store is too small), whether the first tokens and all tokens agree between the two
paths, and the blocks each worker still references afterwards (0: none leaked). Writes benchmarks/results/kv_store_decode-<date>.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_common import machine

from lab_utils import EngineConfig, SamplingParams
from lab_utils.bench.workload import shakespeare_texts
from lab_utils.disagg import DisaggregatedCluster

PREFIX = ("Read the passage below, then continue it in the same voice and metre, keeping every speaker's name as "
          "it is written and never explaining the text. Passage: ")
KEYS = ("bytes_total", "store_put_bytes_total", "store_get_bytes_total", "store_blocks_put", "store_blocks_held",
        "store_blocks_got", "store_blocks_missing", "num_recomputed", "seconds_per_transfer_mean",
        "serialize_s_mean", "send_s_mean", "recv_s_mean", "load_s_mean", "store_put_s_mean", "store_get_s_mean")


def prompts_of(n: int, chars: int, shared_prefix: bool, first: int = 0) -> list[str]:
    """Lab 10's demo prompts (passage i: text i from character 200 i), from passage `first` on."""
    texts = [t for _, t in shakespeare_texts()]
    return [(PREFIX if shared_prefix else "") + texts[i % len(texts)][200 * i: 200 * i + chars]
            for i in range(first, first + n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=6, help="lab 10's DEMO_PROMPTS")
    ap.add_argument("--tokens", type=int, default=24, help="lab 10's DEMO_TOKENS")
    ap.add_argument("--chars", type=int, default=160, help="characters of each passage (lab 10: 160)")
    ap.add_argument("--shared-prefix", action="store_true", help="every prompt starts with the same instruction")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--store-mb", type=float, default=256.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # lab 10's demo engine (its workers run it): fp32, no prefix cache
    cfg = EngineConfig(max_num_seqs=16, max_num_batched_tokens=128, num_gpu_blocks=256, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0)
    arrivals = [0.3 * i for i in range(args.prompts)]
    outs: dict[str, list] = {"pipe": [], "store": []}
    with DisaggregatedCluster(args.model, cfg, dtype="float32") as pipe, \
            DisaggregatedCluster(args.model, cfg, dtype="float32", kv_transfer="store",
                                 kv_store_bytes=int(args.store_mb * 2 ** 20)) as store:
        clusters = {"pipe": pipe, "store": store}
        for r in range(args.rounds):
            prompts = prompts_of(args.prompts, args.chars, args.shared_prefix, first=r * args.prompts)
            for name in (("pipe", "store") if r % 2 == 0 else ("store", "pipe")):
                outs[name] += clusters[name].generate(prompts, params, arrival_times=arrivals)
        leaks = {name: c.worker_stats() for name, c in clusters.items()}  # also takes any late hand-off note
        stats = {name: {k: v for k, v in c.transfer_stats().items() if k in KEYS} for name, c in clusters.items()}
        store_stats = vars(store.store_stats())
    prompt_tokens = [len(o.prompt_token_ids) for o in outs["pipe"]]
    pairs = list(zip(outs["pipe"], outs["store"]))
    res = {
        "machine": machine(), "args": vars(args), "requests": len(pairs), "prompt_tokens": prompt_tokens,
        "hand_offs": stats, "store": store_stats,
        "first_tokens_equal": sum(a.token_ids[0] == b.token_ids[0] for a, b in pairs),
        "all_tokens_equal": sum(a.token_ids == b.token_ids for a, b in pairs),
        "blocks_referenced_after": {n: {w: v["referenced_blocks"] for w, v in r.items()} for n, r in leaks.items()},
    }
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"kv_store_decode-{datetime.now(timezone.utc):%Y%m%d}.json")
    out.write_text(json.dumps(res, indent=1))
    p, s, n = stats["pipe"], stats["store"], len(pairs)
    print(f"{n} requests of {min(prompt_tokens)}-{max(prompt_tokens)} prompt tokens ({args.rounds} rounds), "
          f"totals over all of them:")
    print(f"  pipe : {p['bytes_total'] / 1e6:.2f} MB on the pipe, {p['seconds_per_transfer_mean'] * 1e3:.2f} ms per hand-off")
    print(f"  store: {s['bytes_total'] / 1e6:.2f} MB on the pipe, {s['store_put_bytes_total'] / 1e6:.2f} MB put "
          f"({s['store_blocks_put']:.0f} blocks, {s['store_blocks_held']:.0f} held already), "
          f"{s['store_get_bytes_total'] / 1e6:.2f} MB got ({s['store_blocks_got']:.0f} blocks), "
          f"{s['seconds_per_transfer_mean'] * 1e3:.2f} ms per hand-off (store puts {s['store_put_s_mean'] * 1e3:.2f} ms, "
          f"gets {s['store_get_s_mean'] * 1e3:.2f} ms), {s['num_recomputed']:.0f} recomputed")
    print(f"first tokens equal {res['first_tokens_equal']}/{n}, all tokens equal {res['all_tokens_equal']}/{n}; "
          f"blocks referenced after: {res['blocks_referenced_after']}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
