"""`python -m lab_utils serve --model M --host 127.0.0.1 --port 8000 [engine flags]`."""
from __future__ import annotations

import argparse
import os
import sys

from lab_utils.engine.cli import add_engine_args, engine_config_from_args, torch_dtype
from lab_utils.server.guard import DEFAULT_MAX_BODY_BYTES
from lab_utils.server.offload import COMPILE_TIMEOUT_S


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server over the lab engine")
    add_engine_args(p)  # --model, --device, --dtype and the engine flags with vLLM's names
    p.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    p.add_argument("--extra-model", action="append", default=[], metavar="[NAME=]MODEL",
                   help="also serve MODEL (as NAME; default its model name) on an engine of its own with the same "
                        "engine flags (no speculative decoding); a request's `model` picks one; repeatable")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless told otherwise)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="also accept any key listed in FILE (one per line, 'KEY NAME'; a workshop's api_keys.txt), "
                        "read again whenever the file changes")
    p.add_argument("--max-tokens-cap", type=int, default=1024, help="largest max_tokens a request may get")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="requests that may wait for the engine; more get 503 with Retry-After (0: no bound)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body; larger ones get 413")
    p.add_argument("--max-schema-compile-s", type=float, default=COMPILE_TIMEOUT_S,
                   help="longest a response_format / tools schema may take to compile; longer: 400 schema too complex")
    p.add_argument("--learner-parts", nargs="*", default=[], metavar="PART",
                   help="server parts to load from my_engine/ (LAB_LEARNER_DIR) in place of the reference: "
                        "server.stream_sse")
    p.add_argument("--learner-upto", default=None, metavar="LAB",
                   help="run the engine with the learner's saved parts of labs up to LAB (e.g. 12) from my_engine/ "
                        "(LAB_LEARNER_DIR), the reference for parts not written; prints which is which")
    p.set_defaults(func=serve)


def build_engine(args: argparse.Namespace, model: str | None = None, **overrides):
    """The engine `serve` runs for `model` (default `--model`): with `--learner-upto LAB`, the learner's saved parts
    of the labs up to LAB (their scheduler, block manager, ... where written), the reference for the rest; the
    table goes to the log. `overrides`: EngineConfig fields that differ from the flags."""
    from dataclasses import replace

    from lab_utils.engine.engine import LLMEngine

    parts = None
    if args.learner_upto:
        from lab_utils.course import learner_parts

        parts = learner_parts.parts(upto=args.learner_upto)
    config = replace(engine_config_from_args(args), **overrides)
    return LLMEngine(model or args.model, config, device=args.device, dtype=torch_dtype(args.dtype), parts=parts)


def extra_models(args: argparse.Namespace) -> dict[str, str]:
    """`--extra-model [NAME=]MODEL` flags as {served name: model}."""
    out = {}
    for item in args.extra_model:
        name, _, model = item.rpartition("=")
        out[name or model] = model
    return out


def build_engines(args: argparse.Namespace) -> tuple:
    """The main engine and {name: engine} of the extra models. Each engine's KV budget is its own; on a GPU,
    `--gpu-memory-utilization` is the whole process's share of the card, split evenly between the engines."""
    extras = extra_models(args)
    split = {}
    if extras:
        share = engine_config_from_args(args).gpu_memory_utilization / (1 + len(extras))
        split = {"gpu_memory_utilization": share}
    engine = build_engine(args, **split)
    # a speculative config names the main model's draft: the extra models decode without one
    return engine, {name: build_engine(args, model, speculative=None, **split) for name, model in extras.items()}


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from lab_utils.server.app import create_app
    from lab_utils.server.http_limits import GuardedHttpTools

    if args.api_key_file and not os.path.isfile(args.api_key_file):  # before minutes of loading a model
        print(f"--api-key-file {args.api_key_file}: no such file (one key per line, 'KEY NAME')", file=sys.stderr)
        return 2

    engine, extras = build_engines(args)
    for e in (engine, *extras.values()):
        if e.device.type == "cuda":  # as vLLM at start-up: compile and capture before the first request
            e.warmup()
    name = args.served_model_name or args.model
    app = create_app(engine, name, args.max_tokens_cap, args.api_key,
                     max_waiting=args.max_waiting or None, max_body_bytes=args.max_body_bytes,
                     learner_parts=args.learner_parts, compile_timeout_s=args.max_schema_compile_s,
                     extra_models=extras, api_key_file=args.api_key_file)
    print(f"serving {', '.join([name, *extras])} on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", http=GuardedHttpTools)  # header limits
    return 0
