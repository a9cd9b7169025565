"""Returning turns routed to the other prefill worker: with a shared KV store (Mooncake's layout) vs without.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kv_store.py            # the run in docs/RESULTS.md
    .venv/bin/python benchmarks/kv_store.py --conversations 4 --rounds 1  # a quick look

Workload: lab 11's multi-turn conversations (data/retrieval/conversations.jsonl) behind one system prompt;
each turn's prompt is the whole conversation so far. Two prefill workers (processes, one thread each); turn t
of a conversation goes to worker t % 2, so every returning turn lands on the worker that did not serve the
previous one. Two pools run side by side, one sharing a KV store and one not, and every turn runs on both,
alternating which goes first (the machine is shared; the ratio is taken turn by turn). Reported: the returning
turns' prefill time (median, both pools, and the median of the per-turn ratios), the prompt tokens each pool
computed, the bytes that crossed the store and the time spent in it, and the first tokens of both pools
(equal: reading the KV from the store gives the answer computing it gives). Writes
benchmarks/results/kv_store-<date>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_common import machine

from lab_utils import EngineConfig
from lab_utils.disagg.router import load_tokenizer_for
from lab_utils.kvstore.workers import PrefillWorkers
from lab_utils.paths import DATA_DIR

SYSTEM = ("System: you are a concise assistant for a museum's visitors. Answer in one or two sentences, name your "
          "source when you know it, and say so when you do not know. ")
ANSWER = " Assistant: Here is a short answer drawn from the museum's notes on that subject."


def conversations(n: int) -> list[list[str]]:
    rows = [json.loads(line) for line in (DATA_DIR / "retrieval" / "conversations.jsonl").read_text().splitlines()]
    return [[t["user"] for t in r["turns"]] for r in rows[:n]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2, help="passes over the conversations (new pools each)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tok = load_tokenizer_for(args.model)
    cfg = EngineConfig(num_gpu_blocks=512, block_size=16, enable_prefix_caching=True, max_num_seqs=2)
    turns_out, ratios = [], []
    totals = {"store": {"computed": 0, "prompt": 0}, "apart": {"computed": 0, "prompt": 0}}
    store_stats = {}
    for rnd in range(args.rounds):
        with PrefillWorkers(args.model, cfg, n=2) as shared, PrefillWorkers(args.model, cfg, n=2, use_store=False) as apart:
            pools = {"store": shared, "apart": apart}
            for c, conv in enumerate(conversations(args.conversations)):
                text = SYSTEM
                for t, user in enumerate(conv):
                    text += f" User: {user}"
                    ids = tok.encode(text)
                    order = ("store", "apart") if (c + t + rnd) % 2 == 0 else ("apart", "store")
                    got = {name: pools[name].prefill(t % 2, ids) for name in order}
                    for name, r in got.items():
                        totals[name]["prompt"] += r["prompt_tokens"]
                        totals[name]["computed"] += r["prompt_tokens"] - r["num_cached_tokens"]
                    if t > 0:
                        ratios.append(got["apart"]["seconds"] / got["store"]["seconds"])
                        turns_out.append({"conversation": c, "turn": t, "prompt_tokens": len(ids),
                                          "store_cached": got["store"]["num_cached_tokens"],
                                          "apart_cached": got["apart"]["num_cached_tokens"],
                                          "store_ms": got["store"]["seconds"] * 1e3,
                                          "apart_ms": got["apart"]["seconds"] * 1e3,
                                          "same_first_token": got["store"]["first_token"] == got["apart"]["first_token"]})
                    text += ANSWER
            for w in range(2):
                last = shared.prefill(w, tok.encode("Status check."))
                for k in ("store_bytes_in", "store_bytes_out", "store_seconds"):
                    store_stats[k] = store_stats.get(k, 0) + last[k]
    res = {
        "machine": machine(), "args": vars(args),
        "returning_turns": len(turns_out),
        "median_returning_ms": {"store": statistics.median(t["store_ms"] for t in turns_out),
                                "apart": statistics.median(t["apart_ms"] for t in turns_out)},
        "median_per_turn_ratio_apart_over_store": statistics.median(ratios),
        "prompt_tokens_computed": {k: v["computed"] for k, v in totals.items()},
        "prompt_tokens": totals["store"]["prompt"],
        "same_first_tokens": sum(t["same_first_token"] for t in turns_out),
        "store": store_stats, "turns": turns_out,
    }
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"kv_store-{datetime.now(timezone.utc):%Y%m%d}.json")
    out.write_text(json.dumps(res, indent=1))
    print(f"{res['returning_turns']} returning turns, each on the other worker: prefill median "
          f"{res['median_returning_ms']['store']:.0f} ms with the store, {res['median_returning_ms']['apart']:.0f} ms "
          f"without (per-turn ratio median {res['median_per_turn_ratio_apart_over_store']:.2f}x)")
    print(f"prompt tokens computed: {res['prompt_tokens_computed']} of {res['prompt_tokens']} per pool; "
          f"store: {store_stats['store_bytes_in'] / 1e6:.1f} MB read, {store_stats['store_bytes_out'] / 1e6:.1f} MB "
          f"written, {store_stats['store_seconds']:.2f} s in store calls; first tokens equal on "
          f"{res['same_first_tokens']}/{res['returning_turns']}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
