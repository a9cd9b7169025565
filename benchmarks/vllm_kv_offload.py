"""Lab 14's trace through the lab engine (host tier off / LRU) and through vLLM (offloading off / on).

    .venv/bin/python benchmarks/vllm_kv_offload.py            # lab 14's full-size trace
    .venv/bin/python benchmarks/vllm_kv_offload.py --smoke    # lab 14's SMOKE trace (a quick look)

The trace is lab 14's: lab 11's conversations round-robin, one request at a time, greedy, `--output-tokens`
each, at a device pool of the longest prompt plus a few blocks. Both engines get the same token-id prompts in
the same order. Reported per setting: the prefix hit rate (cached / prompt tokens, all turns and returning
turns) and the returning turns' median TTFT. Where vLLM refuses offloading (its CPU build does), its "offload"
setting is reported as skipped with vLLM's error and the flags for a GPU. Writes
benchmarks/results/vllm_kv_offload-<date>.json with the machine record.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_common import machine

from lab_utils import EngineConfig, LLMEngine, SamplingParams, load_model
from lab_utils.kvstore import returning, vllm_offload
from lab_utils.rag.conversations import DEFAULT_PATH, load_conversations
from lab_utils.rag.corpus import load_corpus


def lab14_trace(tok, conversations: int, turns: int, passage_chars: int, one_offs: int):
    """Lab 14's trace (its section 1)."""
    corpus = load_corpus()
    convos = load_conversations(DEFAULT_PATH, corpus)
    prompts = returning.chat_prompts(convos, corpus, tok, conversations + one_offs, turns, passage_chars=passage_chars)
    ids = [c.id for c in convos if len(c.turns) >= turns][:conversations]
    return returning.round_robin(ids, prompts[:conversations], [p[0] for p in prompts[conversations:]])


def lab_engine(model_tok, trace, output_tokens: int, block_size: int, device_blocks: int, tier_blocks: int) -> dict:
    """The lab engine's settings "off" and "lru" on the trace: the same summary keys as vLLM's."""
    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    out = {}
    for name, tier in (("off", None), ("lru", tier_blocks)):
        cfg = {"block_size": block_size, "num_gpu_blocks": device_blocks, "max_model_len": device_blocks * block_size,
               "max_num_batched_tokens": device_blocks * block_size, "watermark": 0.0, "enable_prefix_caching": True}
        probe = LLMEngine(model_tok, EngineConfig(**cfg), device="cpu")
        per_block = probe.bytes_per_block
        del probe
        engine = LLMEngine(model_tok, EngineConfig(**cfg, kv_offload_bytes=tier and tier * per_block,
                                                   kv_offload_policy="lru"), device="cpu")
        rows = returning.run_trace(engine, trace, params)
        back = returning.returning(rows)
        back_tokens = sum(r.prompt_tokens for r in back)
        out[name] = {
            "hit_rate": sum(r.device_tokens + r.host_tokens for r in rows) / sum(r.prompt_tokens for r in rows),
            "returning_hit_rate": sum(r.device_tokens + r.host_tokens for r in back) / back_tokens,
            "returning_host_share": sum(r.host_tokens for r in back) / back_tokens,
            "returning_ttft_ms": 1e3 * statistics.median(r.ttft_s for r in back),
            "cached_tokens": [r.device_tokens + r.host_tokens for r in rows], "token_ids": [r.token_ids for r in rows],
        }
        out["tier_bytes"] = tier_blocks * per_block
        del engine
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--smoke", action="store_true", help="lab 14's SMOKE sizes")
    ap.add_argument("--output-tokens", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16, help="the lab engine's (vLLM on CPU uses 32)")
    ap.add_argument("--slack-blocks", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sizes = (3, 3, 500, 48, 0) if args.smoke else (8, 4, 1200, 120, 8)  # lab 14's SMOKE and full sizes
    conversations, turns, passage_chars, tier_blocks, one_offs = sizes
    model_tok = load_model(args.model, device="cpu")
    trace = lab14_trace(model_tok[1], conversations, turns, passage_chars, one_offs)
    longest = max(len(t.prompt) for t in trace)
    device_blocks = -(-(longest + args.output_tokens) // args.block_size) + args.slack_blocks
    info = machine()
    lab = lab_engine(model_tok, trace, args.output_tokens, args.block_size, device_blocks, tier_blocks)
    vllm = vllm_offload.compare(trace, args.output_tokens, device_blocks * args.block_size, lab["tier_bytes"],
                                model=args.model)
    same = None
    if "off" in vllm.get("settings", {}):
        same = sum(a == b for a, b in zip(lab["off"]["token_ids"], vllm["settings"]["off"]["token_ids"])) / len(trace)
    info["load_avg_1m_end"] = os.getloadavg()[0]
    result = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": info,
        "trace": {"requests": len(trace), "conversations": conversations, "turns": turns, "one_offs": one_offs,
                  "passage_chars": passage_chars, "longest_prompt": longest, "output_tokens": args.output_tokens,
                  "prompt_tokens": sum(len(t.prompt) for t in trace)},
        "lab": {"block_size": args.block_size, "device_blocks": device_blocks, "tier_blocks": tier_blocks, **lab},
        "vllm": vllm, "same_greedy_outputs_off": same,
    }
    print(f"trace: {len(trace)} requests, prompts up to {longest} tokens; device pool {device_blocks * args.block_size}"
          f" tokens; load {info['load_avg_1m_start']:.2f} -> {info['load_avg_1m_end']:.2f}")
    rows = [("lab", s, lab[s]) for s in ("off", "lru")] + [("vllm", s, v) for s, v in vllm.get("settings", {}).items()]
    for engine, s, v in rows:
        print(f"{engine:5s} {s:8s} hit rate {v['hit_rate']:6.1%}  returning {v['returning_hit_rate']:6.1%}  "
              f"returning TTFT median {v['returning_ttft_ms']:7.1f} ms")
    if "skipped" in vllm:
        print(f"vllm  offload  skipped: {vllm['skipped']}")
    if same is not None:
        print(f"greedy outputs, lab off vs vLLM off: {same:.0%} identical")
    out = Path(args.out or ROOT / "benchmarks" / "results" /
               f"vllm_kv_offload-{datetime.now(timezone.utc):%Y%m%d}{'-smoke' if args.smoke else ''}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    main()
