"""`python -m lab_utils serve --model M --host 127.0.0.1 --port 8000 [engine flags]`."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server over the lab engine")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless told otherwise)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="auto")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--max-tokens-cap", type=int, default=1024, help="largest max_tokens a request may get")
    try:
        from lab_utils.engine.cli import add_engine_args, engine_config_from_args
    except ImportError:  # the shared engine-flag helper is optional
        add_engine_args = engine_config_from_args = None
    if add_engine_args is not None:
        add_engine_args(p)
    p.set_defaults(func=lambda a: serve(a, engine_config_from_args))


def serve(args: argparse.Namespace, to_config) -> int:
    import uvicorn

    from lab_utils.engine.config import EngineConfig
    from lab_utils.engine.engine import LLMEngine
    from lab_utils.server.app import create_app

    config = to_config(args) if to_config is not None else EngineConfig()
    engine = LLMEngine(args.model, config, device=args.device)
    app = create_app(engine, args.served_model_name or args.model, args.max_tokens_cap, args.api_key)
    print(f"serving {args.model} on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
