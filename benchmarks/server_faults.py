"""The server under load with faults: `python -m lab_utils serve` in its own process, N concurrent streams of
which ~20 % leave mid-stream and ~5 % are malformed (lab_utils/server/fault_load.py does the checking).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/server_faults.py                      # smollm2-135m, 200 x 16
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/server_faults.py --model tiny-random --num-requests 400

Reports TTFT p50/p99 of the complete streams, the wall time, and the server's own view afterwards (/metrics:
no KV block in use, nothing running or waiting; /health green). Exits non-zero if any request got the wrong
answer or a block is still held. Writes `benchmarks/results/server_faults-<date>.json`.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_common import machine

from lab_utils.server.fault_load import run_fault_load
from lab_utils.server.process import LabServer


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--disconnect-frac", type=float, default=0.2)
    ap.add_argument("--malformed-frac", type=float, default=0.05)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/server_faults-<date>.json)")
    args = ap.parse_args()

    import httpx

    key = "sk-bench"
    with LabServer(args.model, device=args.device, api_key=key, max_num_seqs=args.max_num_seqs) as srv:
        headers = {"Authorization": f"Bearer {key}"}
        res = run_fault_load(srv.base_url, args.model, n=args.num_requests, disconnect_frac=args.disconnect_frac,
                             malformed_frac=args.malformed_frac, max_tokens=args.max_tokens, headers=headers,
                             timeout_s=1800)
        deadline = time.time() + 60  # let the server notice the last disconnects
        while True:
            text = httpx.get(srv.base_url + "/metrics").text
            idle = metric(text, "lab:num_requests_running") == 0 and metric(text, "lab:num_requests_waiting") == 0
            if idle or time.time() > deadline:
                break
            time.sleep(0.5)
        res["server_after"] = {
            "kv_cache_usage_perc": metric(text, "lab:kv_cache_usage_perc"),
            "num_requests_running": metric(text, "lab:num_requests_running"),
            "num_requests_waiting": metric(text, "lab:num_requests_waiting"),
            "engine_step_failures": metric(text, "lab:engine_step_failures_total"),
            "health": httpx.get(srv.base_url + "/health").status_code,
        }
    res.update(model=args.model, device=args.device, max_num_seqs=args.max_num_seqs, machine=machine(),
               date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"server_faults-{datetime.now():%Y%m%d}.json")
    out.write_text(json.dumps(res, indent=2) + "\n")
    after = res["server_after"]
    ok = not res["problems"] and after["kv_cache_usage_perc"] == 0 and after["health"] == 200
    print(f"{args.model}: {res['num_requests']} requests ({res['num_full']} full, {res['num_left']} left mid-stream, "
          f"{res['num_malformed']} malformed) in {res['wall_s']} s; TTFT p50 {res['ttft_p50_ms']} ms, "
          f"p99 {res['ttft_p99_ms']} ms; KV in use afterwards {after['kv_cache_usage_perc']}; "
          f"problems: {len(res['problems'])}  -> {out}")
    for p in res["problems"][:10]:
        print("  ", p)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
