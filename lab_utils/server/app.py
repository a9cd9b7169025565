"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions (SSE streaming or not), /v1/models,
/health, /metrics.

Everything a request carries is checked before it reaches the engine, and a bad request gets an OpenAI-style
error naming the field and the fix (docs/SERVER.md has the table): 400 bad JSON / field / token id / too long,
401 no key, 404 model, 413 body too large, 503 queue full (with Retry-After) or engine unusable. A failure
inside an engine step ends only the requests it belongs to, with a 500 that says why (see async_engine.py).
`response_format` and `tools` / `tool_choice` become the engine's structured output, as in vLLM (tools.py).

The app is assembled here: the routes (routes.py) over the served models (models.py), one `Frontend` each
(frontend.py: the engine and the settings), the request bodies (schemas.py), the error objects (errors.py), the
streamed and whole answers (responses.py), the key and body-size guard (guard.py).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

from fastapi import FastAPI

from lab_utils.engine.engine import LLMEngine
from lab_utils.server.async_engine import AsyncEngine
from lab_utils.server.errors import install_error_handlers
from lab_utils.server.frontend import Frontend
from lab_utils.server.guard import DEFAULT_MAX_BODY_BYTES, KeyFile, RequestGuard
from lab_utils.server.logprobs import TokenTexts
from lab_utils.server.metrics import ServerMetrics
from lab_utils.server.models import ServedModels
from lab_utils.server.offload import COMPILE_TIMEOUT_S, Offload
from lab_utils.server.openapi import publish
from lab_utils.server.routes import router
from lab_utils.server.streaming import load_stream_part


def create_app(engine: LLMEngine, model_name: str, max_tokens_cap: int = 1024, api_key: str | None = None,
               max_waiting: int | None = 1024, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               learner_parts=(), compile_timeout_s: float = COMPILE_TIMEOUT_S,
               extra_models: dict[str, LLMEngine] | None = None, api_key_file: str | None = None) -> FastAPI:
    """The app over `engine`, served as `model_name`, and over each of `extra_models` (name -> engine), which a
    request picks by its `model` (models.py). `max_waiting` bounds each engine's queue (None: unbounded);
    `max_body_bytes` the body; `compile_timeout_s` a schema's compilation (longer: 400 "schema too complex");
    `learner_parts` (["server.stream_sse"]): the streaming loop is the learner's, loaded from my_engine/.
    `lab:learner_part` on /metrics names every part that is the learner's: the loop's and the engine's.
    `api_key` and `api_key_file` (one key per line, re-read as it changes): /v1/* needs that key or one listed."""
    app = FastAPI(title="LLM Serving Lab server")
    stream_fn, stream_parts = load_stream_part(learner_parts)
    frontends = [_frontend(e, name, stream_fn, stream_parts, max_tokens_cap, max_waiting, compile_timeout_s)
                 for name, e in {model_name: engine, **(extra_models or {})}.items()]
    served = app.state.models = ServedModels(frontends)
    frontend = served.default
    metrics = frontend.metrics  # counts the refusals made before a model is known, for the whole process
    metrics.learner_parts(sorted({*stream_parts, *(n for n in engine.parts.overrides if not n.startswith("server."))}))
    app.state.frontend = frontend
    app.state.engine, app.state.async_engine, app.state.metrics = engine, frontend.aengine, metrics
    app.state.offload = frontend.offload
    key_file = KeyFile(api_key_file) if api_key_file else None
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes, on_reject=metrics.rejected,
                       api_key_file=key_file)
    app.openapi = functools.partial(openapi_with_errors, app, app.openapi)
    for fe in served:
        app.router.add_event_handler("shutdown", fe.aengine.shutdown)
        app.router.add_event_handler("shutdown", fe.offload.shutdown)  # its compile worker processes
    install_error_handlers(app)
    app.include_router(router)
    return app


def _frontend(engine: LLMEngine, name: str, stream_fn, stream_parts, max_tokens_cap: int, max_waiting: int | None,
              compile_timeout_s: float) -> Frontend:
    """One served model: its engine's loop (failure isolation of its own), schema compiler and metrics."""
    engine.keep_history = False  # the server runs for days: no per-step timeline, no table of ended requests
    aengine = AsyncEngine(engine, max_waiting=max_waiting)
    metrics = ServerMetrics(engine)
    aengine.on_output = metrics.observe
    aengine.on_step_failure = metrics.step_failed
    return Frontend(engine, aengine, Offload(engine, compile_timeout_s), metrics, TokenTexts(engine.tokenizer),
                    stream_fn, stream_parts, name, max_tokens_cap)


def openapi_with_errors(app: FastAPI, fastapi_openapi: Callable[[], dict]) -> dict:
    """FastAPI's schema, with every status each route really answers and the models' bounds (built once: token
    ids below the largest vocabulary; a smaller model refuses the ids past its own with a 400)."""
    if app.openapi_schema is None:
        app.openapi_schema = publish(fastapi_openapi(), max(fe.engine.vocab_size for fe in app.state.models))
    return app.openapi_schema
