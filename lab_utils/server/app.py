"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions (SSE streaming or not), /v1/models,
/health, /metrics. Bad requests get OpenAI-style errors: 400 bad JSON/fields/too long, 401 no key, 404 model."""
from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from lab_utils.engine.engine import LLMEngine
from lab_utils.engine.sampling_params import SamplingParams
from lab_utils.server.async_engine import AsyncEngine
from lab_utils.server.metrics import ServerMetrics


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class _Common(BaseModel):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=1)


class CompletionRequest(_Common):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def create_app(engine: LLMEngine, model_name: str, max_tokens_cap: int = 1024, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="LLM Serving Lab server")
    engine.keep_history = False  # the server runs for days: no per-step timeline, no table of ended requests
    aengine = AsyncEngine(engine)
    metrics = ServerMetrics(engine)
    aengine.on_output = metrics.observe
    app.state.engine, app.state.async_engine, app.state.metrics = engine, aengine, metrics

    @app.on_event("shutdown")
    def _shutdown() -> None:
        aengine.shutdown()

    def error(status: int, message: str, kind: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error(exc.status, exc.message, exc.kind)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError):
        parts = []
        for e in exc.errors():
            where = ".".join(str(x) for x in e.get("loc", []) if x != "body")
            parts.append(f"{where or 'body'}: {e.get('msg')}")
        return error(400, "; ".join(parts) or "invalid request", "invalid_request_error")

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error")
        return await call_next(request)

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {model_name!r}", "not_found_error")

    def to_params(req: _Common, max_tokens: int | None) -> SamplingParams:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        return SamplingParams(max_tokens=min(max_tokens or 16, max_tokens_cap), temperature=req.temperature,
                              top_p=req.top_p, top_k=req.top_k, seed=req.seed, stop=stop, ignore_eos=req.ignore_eos)

    def check_length(prompt: str | list[int]) -> None:
        n = len(prompt) if isinstance(prompt, list) else len(engine.tokenizer(prompt, add_special_tokens=False).input_ids)
        if n == 0:
            raise APIError(400, "the prompt is empty", "invalid_request_error")
        if n >= engine.max_model_len:
            raise APIError(400, f"the prompt has {n} tokens but this model's context is {engine.max_model_len} tokens "
                                f"(prompt + at least one output token must fit)", "invalid_request_error")

    @app.get("/health")
    async def health():
        if aengine.error is not None:
            return error(500, f"engine failed: {aengine.error}", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "lab_utils",
                                            "max_model_len": engine.max_model_len}]}

    async def run(prompt, params, kind: str, rid: str, created: int):
        """Yield SSE lines (streaming) in OpenAI's chunk format."""
        sent = ""
        async for out in aengine.generate(prompt, params):
            text = engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            if out.finished:
                text = out.text
            delta, sent = text[len(sent):], text if text.startswith(sent) else sent
            if kind == "chat":
                choice = {"index": 0, "delta": {"content": delta}, "finish_reason": None}
            else:
                choice = {"index": 0, "text": delta, "finish_reason": None}
            choice["token_ids"] = out.new_token_ids  # as vLLM's return_token_ids: exact token accounting
            if out.finished:
                choice["finish_reason"] = _finish(out.finish_reason)
            obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
            chunk = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice]}
            if out.finished:
                chunk["usage"] = _usage(out)
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    async def complete(prompt, params, kind: str, stream: bool):
        check_length(prompt)
        rid, created = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:16]}", int(time.time())
        if stream:
            return StreamingResponse(run(prompt, params, kind, rid, created), media_type="text/event-stream")
        final = None
        async for out in aengine.generate(prompt, params):
            final = out
        if final.finish_reason and final.finish_reason.startswith("rejected"):
            raise APIError(400, final.finish_reason, "invalid_request_error")
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": final.text},
                      "finish_reason": _finish(final.finish_reason)}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": final.text, "finish_reason": _finish(final.finish_reason)}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice],
                "usage": _usage(final)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_model(req.model)
        return await complete(req.prompt, to_params(req, req.max_tokens), "text", req.stream)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        check_model(req.model)
        msgs = [m.model_dump() for m in req.messages]
        prompt = engine.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return await complete(prompt, to_params(req, req.max_completion_tokens or req.max_tokens), "chat", req.stream)

    return app


def _finish(reason: str | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason == "length" else "stop" if reason == "stop" else reason.split(":")[0]


def _usage(out) -> dict:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
