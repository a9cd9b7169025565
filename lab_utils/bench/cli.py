"""`python -m lab_utils bench`: one workload, one backend, one table and one JSON (vLLM `bench serve` keys).

    python -m lab_utils bench --backend lab --scheduler continuous --num-prompts 32 --input-len 32 \
        --output-len 64 --length-dist longtail --request-rate inf --max-num-seqs 8 --json out.json
    python -m lab_utils bench --compare a.json b.json      # one table for saved results
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import datetime, timezone
from pathlib import Path

from lab_utils.bench.backends import BACKENDS, PLANNED, make_backend
from lab_utils.bench.workload import LENGTH_DISTS
from lab_utils.engine.cli import add_engine_args, engine_config_from_args, parse_rate, torch_dtype


def build_workload(args: argparse.Namespace):
    from lab_utils.bench.workload import Workload, make_workload

    if args.workload and Path(args.workload).exists():
        wl = Workload.load(args.workload)
        print(f"workload {args.workload}: {len(wl)} requests, sha256 {wl.content_hash[:12]}")
        return wl
    from lab_utils.models.loader import model_folder
    from lab_utils.models.registry import lookup
    from lab_utils.models.tokenizer import load_tokenizer

    spec, _ = lookup(args.model)
    tok = load_tokenizer(model_folder(spec.tokenizer_from if spec and spec.kind == "random" else args.model))
    wl = make_workload(tok, args.num_prompts, args.input_len, args.output_len, length_dist=args.length_dist,
                       input_dist=args.input_dist, request_rate=args.request_rate, burstiness=args.burstiness,
                       seed=args.seed, sigma=args.longtail_sigma, max_factor=args.longtail_max_factor,
                       range_ratio=args.range_ratio, tokenizer_name=args.model)
    if args.workload:
        wl.save(args.workload)
        print(f"saved workload {args.workload} (sha256 {wl.content_hash[:12]})")
    return wl


def make_backend_from_args(args: argparse.Namespace):
    dtype = torch_dtype(args.dtype)
    if args.backend == "lab":
        return make_backend("lab", model=args.model, config=engine_config_from_args(args), device=args.device, dtype=dtype)
    if args.backend == "hf":
        return make_backend("hf", model=args.model, batch_size=args.max_num_seqs or 8, device=args.device, dtype=dtype)
    return make_backend(args.backend, model=args.model, args=args)  # backends added later read what they need


def run(args: argparse.Namespace) -> int:
    from lab_utils.bench.report import format_table, load_results

    if args.compare:
        print(format_table(load_results(args.compare)))
        return 0
    try:
        backend = make_backend_from_args(args)
        wl = build_workload(args)
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    lens = wl.output_lens
    print(f"{len(wl)} requests, input {sum(wl.input_lens) / len(wl):.0f} tokens, output {min(lens)}..{max(lens)} "
          f"tokens (mean {sum(lens) / len(lens):.1f}, {args.length_dist}), rate {args.request_rate} req/s; "
          f"backend {args.backend} {backend.describe()}")
    bench = backend.run(wl, warmup=not args.no_warmup)
    result = bench.summary(args.slo_ttft_ms, args.slo_tpot_ms, workload=wl, detailed=True)
    result["date"] = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    result["versions"] = _versions()
    print(format_table([result]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=_jsonable) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    backend.close()
    return 0


def _jsonable(x):
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return str(x)


def _versions() -> dict:
    import platform

    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark a backend on a seeded workload (TTFT, TPOT, ITL, E2E, goodput)")
    p.add_argument("--backend", default="lab", choices=sorted(set(BACKENDS) | set(PLANNED)),
                   help="lab (the course engine), hf (transformers generate, static batches); "
                        f"planned: {', '.join(sorted(PLANNED)) or 'none'}")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (mean, with --input-dist)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (mean, with --length-dist)")
    p.add_argument("--length-dist", choices=LENGTH_DISTS, default="fixed", help="output length distribution")
    p.add_argument("--input-dist", choices=LENGTH_DISTS, default="fixed", help="prompt length distribution")
    p.add_argument("--longtail-sigma", type=float, default=1.5, help="lognormal sigma of `longtail` (default 1.5)")
    p.add_argument("--longtail-max-factor", type=float, default=8.0, help="`longtail` cap, x mean (default 8)")
    p.add_argument("--range-ratio", type=float, default=0.5, help="`uniform`: mean x (1 ± ratio) (default 0.5)")
    p.add_argument("--request-rate", type=parse_rate, default=math.inf, help="requests/s, Poisson (inf = burst)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--workload", default=None, help="load this workload JSON if it exists, else save it there")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT SLO for goodput")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT SLO for goodput")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up request")
    p.add_argument("--base-url", default=None, help="http backend: server root (default $OPENAI_BASE_URL or "
                                                   "http://127.0.0.1:8000)")
    p.add_argument("--max-concurrency", type=int, default=None, help="http backend: most requests in flight")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--compare", nargs="+", metavar="JSON", help="print one table for saved results and exit")
    add_engine_args(p)
    p.set_defaults(func=run)
