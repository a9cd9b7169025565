"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions (SSE streaming or not), /v1/models,
/health, /metrics.

Everything a request carries is checked before it reaches the engine, and a bad request gets an OpenAI-style
error naming the field and the fix (docs/SERVER.md has the table): 400 bad JSON / field / token id / too long,
401 no key, 404 model, 413 body too large, 503 queue full (with Retry-After) or engine unusable. A failure
inside an engine step ends only the requests it belongs to, with a 500 that says why (see async_engine.py).
`response_format` and `tools` / `tool_choice` become the engine's structured output, as in vLLM (tools.py).
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictFloat, StrictInt, StringConstraints,
                      ValidationInfo, field_validator)
from starlette.exceptions import HTTPException as StarletteHTTPException

from lab_utils.engine.engine import LLMEngine
from lab_utils.engine.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_STRINGS, PENALTY_RANGE, SEED_RANGE, SamplingParams
from lab_utils.structured.hook import DEAD_END
from lab_utils.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError, Stream
from lab_utils.server.guard import DEFAULT_MAX_BODY_BYTES, RequestGuard, document_errors
from lab_utils.server.logprobs import StreamLogprobs, TokenTexts, chat_logprobs, completion_logprobs
from lab_utils.server.messages import ROLES, ChatMessage, ConversationError, check_conversation, for_template, size_of
from lab_utils.server.metrics import ServerMetrics
from lab_utils.server.offload import COMPILE_TIMEOUT_S, CompilerBusy, Offload, SchemaTooComplex
from lab_utils.server.stream_text import StreamText
from lab_utils.server.streaming import StreamOptions, load_stream_part, openai_framing
from lab_utils.server.tools import (NamedToolChoice, ResponseFormat, Tool, ToolRequestError, chat_reply, render_chat,
                                    structured_output, tool_mode, tool_schema)

RETRY_AFTER_S = 1  # what a 503 "queue full" asks the client to wait


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers
        self.code = code


# -- request bodies: one field per line, so new ones (response_format, tools, ...) are one line each ----------
StopString = Annotated[str, StringConstraints(min_length=1, max_length=256)]
# OpenAI fields this server does not implement (top_logprobs on /v1/completions, echo on chat: not fields of those
# endpoints), with the values that ask for nothing (accepted); any other value is a 400 naming the field, never
# silently ignored
NOT_IMPLEMENTED = {"best_of": (1,), "suffix": ("",), "top_logprobs": (0,), "echo": (False,)}


def _refuse(v, info: ValidationInfo):
    neutral = NOT_IMPLEMENTED[info.field_name]
    if v is None or (type(v) is not bool or type(neutral[0]) is bool) and v in neutral:
        return None
    raise ValueError(f"{v!r} is not supported by this server; omit {info.field_name} or send "
                     f"{json.dumps(neutral[0])}")


Unsupported = Annotated[Any, BeforeValidator(_refuse)]
Penalty = Annotated[StrictFloat | None, Field(default=None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1],
                                              allow_inf_nan=False, description="in [-2, 2]; 0 or null: off")]


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields this server does not use (user, ...)

    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=1, description="capped at the server's --max-tokens-cap")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1, description="0 or -1: off")
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = Field(default=None, description="only with stream: true")
    return_token_ids: bool = Field(default=False, description="vLLM's: each choice carries its token ids (each "
                                                              "chunk the new ones), and the prompt's are returned")
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=1, description="one choice per request")
    response_format: ResponseFormat | None = None  # {"type": "json_object"} | {"type": "json_schema", ...}
    # the sampler's logit processors (vLLM's definitions; docs/SERVER.md)
    logit_bias: dict[int, float] | None = Field(default=None, description="token id (a string) -> bias in [-100, 100]")
    frequency_penalty: Penalty
    presence_penalty: Penalty
    repetition_penalty: StrictFloat | None = Field(default=None, gt=0.0, allow_inf_nan=False,
                                                   description="> 0; 1 or null: off (vLLM's)")
    min_tokens: StrictInt | None = Field(default=None, ge=0, description="at most max_tokens (vLLM's)")
    best_of: Unsupported = None
    suffix: Unsupported = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v):
        """One message naming the bad entry (param `logit_bias`), not pydantic's per-key errors."""
        if v is None:
            return None
        if not isinstance(v, dict):
            raise ValueError("must be an object mapping token ids (as strings) to a bias in [-100, 100]")
        out = {}
        for key, bias in v.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"key {key!r} is not a token id: keys are token ids such as \"50256\"") from None
            if token < 0:
                raise ValueError(f"key {key!r} is not a token id: token ids are >= 0")
            if type(bias) not in (int, float) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails too
                raise ValueError(f"{key}: {bias!r} is not a bias: send a number in [-100, 100]")
            out[token] = float(bias)
        return out


class CompletionRequest(_Common):
    prompt: Annotated[str, StringConstraints(min_length=1)] | Annotated[list[int], Field(min_length=1)]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5, description="logprobs of each token and of the "
                                       "k most likely (0-5)")
    echo: bool = Field(default=False, description="the prompt (and its logprobs) before the completion")
    top_logprobs: Unsupported = None  # chat's field: here `logprobs` is the count

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        if (isinstance(v, str) and v) or (isinstance(v, list) and v and all(type(t) is int for t in v)):
            return v
        raise ValueError("must be a non-empty string or a non-empty list of token ids (ints); one prompt per request")


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, description="system, developer, user, assistant (content "
                                        "null with tool_calls) and tool (with tool_call_id) messages; content a "
                                        "string or a list of text parts")
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20, description="needs logprobs: true")
    echo: Unsupported = None  # a completions field

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v, info: ValidationInfo):
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v


def create_app(engine: LLMEngine, model_name: str, max_tokens_cap: int = 1024, api_key: str | None = None,
               max_waiting: int | None = 1024, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               learner_parts=(), compile_timeout_s: float = COMPILE_TIMEOUT_S) -> FastAPI:
    """The app over one engine. `max_waiting` bounds the queue (None: unbounded); `max_body_bytes` the body;
    `compile_timeout_s` a schema's compilation (longer: 400 "schema too complex");
    `learner_parts` (["server.stream_sse"]): the streaming loop is the learner's, loaded from my_engine/.
    `lab:learner_part` on /metrics names every part that is the learner's: the loop's and the engine's."""
    app = FastAPI(title="LLM Serving Lab server")
    engine.keep_history = False  # the server runs for days: no per-step timeline, no table of ended requests
    aengine = AsyncEngine(engine, max_waiting=max_waiting)
    offload = Offload(engine, compile_timeout_s)  # schema compilation, long texts' tokenisation: off the loop
    metrics = ServerMetrics(engine)
    token_texts = TokenTexts(engine.tokenizer)  # token id -> text and bytes, for logprobs
    stream_fn, stream_parts = load_stream_part(learner_parts)
    metrics.learner_parts(sorted({*stream_parts, *(n for n in engine.parts.overrides if not n.startswith("server."))}))
    aengine.on_output = metrics.observe
    aengine.on_step_failure = metrics.step_failed
    app.state.engine, app.state.async_engine, app.state.metrics = engine, aengine, metrics
    app.state.offload = offload
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes, on_reject=metrics.rejected)
    fastapi_openapi = app.openapi

    def openapi() -> dict:  # FastAPI's schema, with the error object every error status really answers
        if app.openapi_schema is None:
            generation = [400, 401, 404, 413, 500, 503]
            app.openapi_schema = document_errors(fastapi_openapi(), {
                "/v1/completions": generation, "/v1/chat/completions": generation, "/v1/models": [401],
                "/health": [500]})
        return app.openapi_schema

    app.openapi = openapi

    @app.on_event("shutdown")
    def _shutdown() -> None:
        aengine.shutdown()

    def error(status: int, message: str, kind: str, param: str | None = None,
              headers: dict[str, str] | None = None, code: str | None = None) -> JSONResponse:
        if status < 500 or status == 503:
            metrics.rejected(status)
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                            status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error(exc.status, exc.message, exc.kind, exc.param, exc.headers, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # 404 unknown path, 405 wrong method, ...
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        why = {404: f"{request.url.path} is not an endpoint of this server (see /docs)",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        if exc.status_code == 400:  # the body could not be parsed at all (not UTF-8, nested too deep, ...)
            why += "; send a JSON object as the body (Content-Type: application/json)"
        return error(exc.status_code, why, kind, None, dict(exc.headers or {}) or None)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):  # a bug: still OpenAI's error object, never a bare text
        return error(500, f"the server failed on this request ({type(exc).__name__}: {exc})", "server_error")

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError):
        parts, params = [], []
        for e in exc.errors():
            where = _where(e.get("loc", []))
            if e.get("type") == "json_invalid":
                where = ""  # the body itself: loc holds the character position
            params.append(where or None)
            parts.append(f"{where or 'body'}: {e.get('msg')}")
        if any(e.get("type") == "json_invalid" or not _where(e.get("loc", [])) for e in exc.errors()):
            parts.append("send a JSON object as the body (Content-Type: application/json)")
        return error(400, "; ".join(dict.fromkeys(parts)) or "invalid request", "invalid_request_error",
                     params[0] if params else None)

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {model_name!r}", "not_found_error",
                           "model")

    def to_params(req: _Common, max_tokens: int | None, structured: dict | None = None) -> SamplingParams:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        outside = [t for t in req.logit_bias or {} if t >= engine.vocab_size]
        if outside:
            raise APIError(400, f"logit_bias: token id {outside[0]} is outside this model's vocabulary: token ids "
                                f"are in [0, {engine.vocab_size})", param="logit_bias")
        if isinstance(req, ChatRequest):
            logprobs, prompt_logprobs = (req.top_logprobs or 0) if req.logprobs else None, None
        else:
            logprobs, prompt_logprobs = req.logprobs, req.logprobs if req.echo else None
        try:
            return SamplingParams(max_tokens=min(max_tokens or 16, max_tokens_cap), temperature=req.temperature,
                                  top_p=req.top_p, top_k=max(req.top_k, 0), seed=req.seed, stop=stop,
                                  ignore_eos=req.ignore_eos, structured_output=structured,
                                  logit_bias=req.logit_bias, min_tokens=req.min_tokens or 0,
                                  repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                                  frequency_penalty=req.frequency_penalty or 0.0,
                                  presence_penalty=req.presence_penalty or 0.0,
                                  logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        except ValueError as exc:  # "SamplingParams.<field>=<value> is invalid: must be ..."
            message = str(exc).removeprefix("SamplingParams.")
            raise APIError(400, message, param=message.split("=")[0]) from None

    async def constraint(req: _Common, mode: str | None = None) -> dict | None:
        """response_format / a forced tool_choice -> the engine's structured_output, compiled here (in a worker
        thread, cached, time-limited) so a schema the grammar compiler refuses, one that admits no output, or one
        too slow to compile is a 400 naming the field."""
        param = grammar_param(mode)
        try:
            so = structured_output(req.response_format, getattr(req, "tools", None), mode,
                                   getattr(req, "parallel_tool_calls", None))
            if so is not None and req.stop:  # a stop string inside the JSON would end it half-written
                raise ToolRequestError(f"stop strings would cut the JSON that {param} asks for (the output would "
                                       f"not parse): send stop only without a JSON constraint", "stop")
            if mode == "required":  # each tool's parameters alone: one that admits nothing is known here
                for i, tool in enumerate(req.tools):
                    try:
                        await offload.compile(tool_schema(tool))
                    except SchemaTooComplex:
                        raise
                    except ValueError as exc:
                        raise ToolRequestError(f"tools[{i}].function.parameters: {exc}", "tools") from None
            await offload.compile(so)
        except ToolRequestError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        except SchemaTooComplex as exc:
            raise APIError(400, f"{param}: {exc}", param=param, code="schema_too_complex") from None
        except CompilerBusy as exc:
            raise APIError(503, str(exc), "server_busy", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as exc:  # "structured_output.json could not be compiled: <why>"
            raise APIError(400, f"{param}: {exc}", param=param) from None
        return so

    def grammar_param(mode: str | None) -> str:
        return "tools" if mode not in (None, "auto") else "response_format"

    async def token_ids(prompt: str | list[int], param: str) -> list[int]:
        """Text -> ids (once, here; a long text in a worker thread); ids are checked by the engine's add_request."""
        if isinstance(prompt, list):
            return prompt
        try:
            return await offload.run(lambda: engine.tokenizer(prompt, add_special_tokens=False).input_ids,
                                     size=len(prompt))
        except (TypeError, ValueError, UnicodeError) as exc:
            raise APIError(400, f"{param}: the text cannot be tokenized ({type(exc).__name__}): send valid UTF-8 "
                                f"text (no lone surrogates such as \\ud800)", param=param) from None

    def submit(ids: list[int], params: SamplingParams, param: str) -> Stream:
        """Check the request against this engine and queue it; every refusal is an HTTP error, sent before any
        response has started."""
        if not ids:
            raise APIError(400, "the prompt is empty: give at least one token", param=param)
        why = engine.check_request(len(ids), params)
        if why:
            raise APIError(400, why, param=param)
        try:
            return aengine.add(ids, params)
        except ValueError as exc:  # the engine's own checks: token ids outside the vocabulary, ...
            raise APIError(400, str(exc), param=param) from None
        except QueueFullError as exc:
            raise APIError(503, str(exc), "server_busy", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "server_error") from None

    @app.get("/health")
    async def health():
        if aengine.error is not None:
            return JSONResponse({"error": {"message": f"engine failed: {aengine.error}", "type": "server_error",
                                           "param": None, "code": None}}, status_code=500)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "lab_utils",
                                            "max_model_len": engine.max_model_len}]}

    async def sse(stream: Stream, stops: list[str], kind: str, rid: str, created: int, grammar: str | None,
                  echo: str | None = None, req: _Common | None = None, prompt_ids: list[int] | None = None,
                  mode: str | None = None, tools: list[Tool] | None = None):
        """SSE lines in OpenAI's chunk format, from the streaming loop (`streaming.stream_sse`, or the learner's);
        the chunks' text adds up to the non-streamed text. A chat stream starts with the role chunk; the usage
        comes as a last chunk of its own when `stream_options.include_usage` asks for it; token ids come when
        `return_token_ids` asks for them. With tools in play, the reply is sent whole in the last chunk, as
        `delta.tool_calls` or `delta.content` (which it is shows only at its end)."""
        include_usage = bool(req and req.stream_options and req.stream_options.include_usage)
        with_ids = bool(req and req.return_token_ids)
        final_usage: dict = {}
        text = StreamText(engine.tokenizer, stops)
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        extra = StreamLogprobs(token_texts, kind, echo)  # each chunk's logprobs; the echoed prompt on the first

        def to_chunk(out) -> dict:
            if out.finished and out.finish_reason == DEAD_END:
                return {"error": {"message": out.finish_reason, "type": "invalid_request_error",
                                  "param": grammar, "code": "grammar_dead_end"}}
            if out.finished and out.finish_reason and out.finish_reason.startswith("error"):
                return {"error": {"message": out.finish_reason, "type": "server_error", "param": None, "code": None}}
            delta = text.delta(out.new_token_ids)
            if out.finished:
                delta += text.final(out.text)
            prefix, logprobs = extra.take(out)
            delta = prefix + delta
            if kind == "chat":
                choice = {"index": 0, "delta": {"content": delta}, "finish_reason": None}
            else:
                choice = {"index": 0, "text": delta, "finish_reason": None}
            if with_ids:  # vLLM's return_token_ids: exact token accounting
                if kind != "chat" and "prompt_ids_sent" not in final_usage:  # a completion's first chunk
                    choice["prompt_token_ids"] = final_usage["prompt_ids_sent"] = prompt_ids
                choice["token_ids"] = out.new_token_ids
            choice["logprobs"] = logprobs
            if out.finished:
                choice["finish_reason"] = _finish(out.finish_reason)
            if kind == "chat" and mode is not None:  # tools: content or tool calls, known once the reply is whole
                choice["delta"] = {}
                if out.finished:
                    message, choice["finish_reason"] = chat_reply(out.text, mode, tools, _finish(out.finish_reason))
                    calls = message.get("tool_calls")
                    choice["delta"] = ({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]} if calls
                                       else {"content": message["content"]})
            chunk = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice]}
            if include_usage:
                chunk["usage"] = None  # OpenAI: null on every chunk but the last
            if out.finished:
                final_usage["usage"] = _usage(out)
            return chunk

        def head(**fields) -> dict:
            return {"id": rid, "object": obj, "created": created, "model": model_name, **fields}

        first = None
        if kind == "chat":
            first = head(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}])
            if with_ids:
                first["prompt_token_ids"] = prompt_ids
            if include_usage:
                first["usage"] = None

        def usage_chunk() -> dict | None:
            return head(choices=[], usage=final_usage["usage"]) if include_usage and "usage" in final_usage else None

        try:
            async for line in openai_framing(stream_fn(aengine.outputs(stream, abort_on_exit=False), to_chunk,
                                                       lambda: aengine.abort(stream.request_id)), first, usage_chunk):
                yield line
        except EngineDeadError as exc:
            yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'server_error', 'param': None, 'code': None}})}\n\n"
            yield "data: [DONE]\n\n"
        except Exception as exc:  # a learner's loop that raised: the client is told, the request is ended
            aengine.abort(stream.request_id)
            why = f"the streaming loop ({stream_parts or 'reference'}) raised {type(exc).__name__}: {exc}"
            yield f"data: {json.dumps({'error': {'message': why, 'type': 'server_error', 'param': None, 'code': None}})}\n\n"
            yield "data: [DONE]\n\n"

    async def complete(raw: Request, ids: list[int], params: SamplingParams, kind: str, req: _Common, param: str,
                       mode: str | None = None, tools: list[Tool] | None = None, echo: str | None = None):
        """`echo`: the prompt's text, put before the completion's (its logprobs too, if asked)."""
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        handle = submit(ids, params, param)
        rid, created = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:16]}", int(time.time())
        grammar = grammar_param(mode) if params.structured_output is not None else None
        if req.stream:
            return StreamingResponse(sse(handle, params.stop, kind, rid, created, grammar, echo, req, ids, mode,
                                         tools), media_type="text/event-stream")
        final = await until_done_or_gone(raw, handle)
        if final is None:  # the client left: its request was aborted, its KV blocks are free
            return Response(status_code=499)
        if final.finish_reason == DEAD_END:
            raise APIError(400, f"{grammar}: {final.finish_reason}", param=grammar, code="grammar_dead_end")
        if final.finish_reason and final.finish_reason.startswith("error"):
            raise APIError(500, final.finish_reason, "server_error")
        if final.finish_reason and final.finish_reason.startswith("rejected"):
            raise APIError(400, final.finish_reason, param=param)
        if kind == "chat":
            message, finish = chat_reply(final.text, mode, tools, _finish(final.finish_reason))  # tool_calls
            choice = {"index": 0, "message": message, "finish_reason": finish,
                      "logprobs": None if final.logprobs is None else chat_logprobs(final.logprobs, token_texts)}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": (echo or "") + final.text, "finish_reason": _finish(final.finish_reason),
                      "logprobs": completion_choice_logprobs(final, echo is not None)}
            obj = "text_completion"
        body = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice],
                "usage": _usage(final)}
        if req.return_token_ids:  # vLLM's places: the prompt's ids on the response (chat) or the choice
            choice["token_ids"] = list(final.token_ids)
            (body if kind == "chat" else choice)["prompt_token_ids"] = list(final.prompt_token_ids)
        return body

    def prompt_text(ids: list[int]) -> str:
        """Token ids as text, for echo (ids outside the vocabulary: "", and the engine refuses the request)."""
        try:
            return engine.tokenizer.decode(ids)
        except (OverflowError, TypeError, ValueError):
            return ""

    def completion_choice_logprobs(out, echo: bool) -> dict | None:
        if out.logprobs is None:
            return None
        ids, entries = list(out.token_ids), list(out.logprobs)
        if echo:
            ids, entries = out.prompt_token_ids + ids, out.prompt_logprobs + entries
        return completion_logprobs(ids, entries, token_texts)[0]

    async def until_done_or_gone(raw: Request, handle: Stream):
        """The request's last output, or None if its client disconnected first (then the request is aborted
        at once: a non-streamed request's blocks go back as a stream's do)."""
        async def collect():
            final = None
            async for out in aengine.outputs(handle):
                final = out
            return final

        async def client_gone():
            while (await raw.receive())["type"] != "http.disconnect":
                await asyncio.sleep(0.05)  # (the body's end may be said twice; never spin)

        work, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()  # aengine.outputs aborts the request as it is cancelled
        if not work.done() or work.cancelled():
            aengine.abort(handle.request_id)
            return None
        try:
            return work.result()
        except EngineDeadError as exc:
            raise APIError(500, str(exc), "server_error") from None

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        check_model(req.model)
        params = to_params(req, req.max_tokens, await constraint(req))
        ids = await token_ids(req.prompt, "prompt")
        echo = (req.prompt if isinstance(req.prompt, str) else prompt_text(ids)) if req.echo else None
        return await complete(raw, ids, params, "text", req, "prompt", echo=echo)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, raw: Request):
        check_model(req.model)
        try:
            mode = tool_mode(req.tools, req.tool_choice)  # None | "auto" | "required" | "function:<name>"
        except ToolRequestError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        try:
            check_conversation(req.messages)  # each tool message answers a call made just before it
        except ConversationError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        params = to_params(req, req.max_completion_tokens or req.max_tokens, await constraint(req, mode))
        msgs = for_template(req.messages)
        try:  # tools shown to the model; a long conversation is rendered in a worker thread
            prompt = await offload.run(render_chat, engine.tokenizer, msgs, req.tools, mode, size=size_of(msgs))
        except Exception as exc:  # noqa: BLE001 - a template that refuses these messages is the client's problem
            raise APIError(400, f"the chat template refused these messages ({type(exc).__name__}: {exc}); check "
                                f"the roles' order and the contents' text", param="messages") from None
        return await complete(raw, await token_ids(prompt, "messages"), params, "chat", req, "messages",
                              mode, req.tools)

    return app


_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = {"int", "str", "float", "bool", "none", "dict", "list"}


def _where(loc) -> str:
    """A validation error's place as fields and indices (`messages.0.content`): the tags pydantic adds for a
    union's member (`constrained-str`, `list[int]`, a model's class name, a message's role) and dict keys left
    out, so `param` names a field of the request."""
    out = []
    for i, x in enumerate(loc):
        if isinstance(x, int):
            out.append(str(x))
        elif i == 0 and x == "body" or not _FIELD.match(x) or x in _TYPE_TAGS:
            continue
        elif x in ROLES and i and isinstance(loc[i - 1], int):
            continue  # messages.<i>.<role tag>
        else:
            out.append(x)
    return ".".join(out)


def _finish(reason: str | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason == "length" else "stop" if reason == "stop" else reason.split(":")[0]


def _usage(out) -> dict:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
