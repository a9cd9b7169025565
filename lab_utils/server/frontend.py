"""The server's state over one engine, and the checks that turn a request body into the engine's request.

`Frontend` holds what every route needs (the engine, its loop, the worker pool, the metrics, the settings); the
app keeps one per served model (models.py) and a route answers with the one its request's `model` names. Its checks raise
`APIError`, so every refusal is an HTTP error sent before any response has started.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from lab_utils.engine.engine import LLMEngine
from lab_utils.engine.sampling_params import SamplingParams
from lab_utils.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError, Stream
from lab_utils.server.errors import APIError
from lab_utils.server.logprobs import TokenTexts
from lab_utils.server.metrics import ServerMetrics
from lab_utils.server.offload import CompilerBusy, Offload, SchemaTooComplex
from lab_utils.server.schemas import ChatRequest, CommonFields
from lab_utils.server.tools import ToolRequestError, structured_output, tool_schema
from lab_utils.structured.schema import ServerLimit

RETRY_AFTER_S = 1  # what a 503 "queue full" asks the client to wait


def grammar_param(mode: str | None) -> str:
    """The request field a JSON constraint comes from: `tools` (a forced tool call) or `response_format`."""
    return "tools" if mode not in (None, "auto") else "response_format"


@dataclass
class Frontend:
    engine: LLMEngine
    aengine: AsyncEngine  # the engine's loop in its thread: add, abort, outputs
    offload: Offload  # schema compilation, long texts' tokenisation: off the event loop
    metrics: ServerMetrics
    token_texts: TokenTexts  # token id -> text and bytes, for logprobs
    stream_fn: Callable  # the streaming loop: the reference `streaming.stream_sse` or the learner's
    stream_parts: list[str]  # [STREAM_PART] when the streaming loop is the learner's
    model_name: str
    max_tokens_cap: int

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def to_params(self, req: CommonFields, max_tokens: int | None, structured: dict | None = None) -> SamplingParams:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        outside = [t for t in req.logit_bias or {} if t >= self.engine.vocab_size]
        if outside:
            raise APIError(400, f"logit_bias: token id {outside[0]} is outside this model's vocabulary: token ids "
                                f"are in [0, {self.engine.vocab_size})", param="logit_bias")
        if isinstance(req, ChatRequest):
            logprobs, prompt_logprobs = (req.top_logprobs or 0) if req.logprobs else None, None
        else:
            logprobs, prompt_logprobs = req.logprobs, req.logprobs if req.echo else None
        try:
            return SamplingParams(max_tokens=min(max_tokens or 16, self.max_tokens_cap), temperature=req.temperature,
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

    async def constraint(self, req: CommonFields, mode: str | None = None) -> dict | None:
        """response_format / a forced tool_choice -> the engine's structured_output, compiled here (in a worker
        thread, cached, time-limited) so a schema the grammar compiler refuses, one that admits no output, or one
        too slow to compile is a 400 naming the field."""
        param = grammar_param(mode)
        args = (req.response_format, getattr(req, "tools", None), mode, getattr(req, "parallel_tool_calls", None))
        try:
            if mode == "required":  # each tool's parameters alone first: the refusal names the tool
                for i, tool in enumerate(req.tools):
                    try:
                        await self.offload.compile(tool_schema(tool))
                    except (SchemaTooComplex, ServerLimit):
                        raise
                    except ValueError as exc:
                        raise ToolRequestError(f"tools[{i}].function.parameters: {exc}", "tools") from None
                # the calls' grammar is built from every tool's: in a thread, off the event loop
                so = await asyncio.get_running_loop().run_in_executor(None, structured_output, *args)
            else:
                so = structured_output(*args)
            if so is not None and req.stop:  # a stop string inside the JSON would end it half-written
                raise ToolRequestError(f"stop strings would cut the JSON that {param} asks for (the output would "
                                       f"not parse): send stop only without a JSON constraint", "stop")
            await self.offload.compile(so)
        except ToolRequestError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        except (SchemaTooComplex, ServerLimit) as exc:  # too slow to compile, or too deep to check
            raise APIError(400, f"{param}: {exc}", param=param, code="schema_too_complex") from None
        except CompilerBusy as exc:
            raise APIError(503, str(exc), "server_busy", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as exc:  # "structured_output.json could not be compiled: <why>"
            raise APIError(400, f"{param}: {exc}", param=param) from None
        return so

    async def token_ids(self, prompt: str | list[int], param: str) -> list[int]:
        """Text -> ids (once, here; a long text in a worker thread); ids are checked by the engine's add_request."""
        if isinstance(prompt, list):
            return prompt
        try:
            return await self.offload.run(lambda: self.tokenizer(prompt, add_special_tokens=False).input_ids,
                                          size=len(prompt))
        except (TypeError, ValueError, UnicodeError) as exc:
            raise APIError(400, f"{param}: the text cannot be tokenized ({type(exc).__name__}): send valid UTF-8 "
                                f"text (no lone surrogates such as \\ud800)", param=param) from None

    def prompt_text(self, ids: list[int]) -> str:
        """Token ids as text, for echo (ids outside the vocabulary: "", and the engine refuses the request)."""
        try:
            return self.tokenizer.decode(ids)
        except (OverflowError, TypeError, ValueError):
            return ""

    async def submit(self, ids: list[int], params: SamplingParams, param: str) -> Stream:
        """Check the request against this engine and queue it; every refusal is an HTTP error, sent before any
        response has started."""
        if not ids:
            raise APIError(400, "the prompt is empty: give at least one token", param=param)
        why = self.engine.check_request(len(ids), params)
        if why:
            raise APIError(400, why, param=param)
        try:
            stream = self.aengine.add(ids, params)
            await self.aengine.admitted(stream)  # the engine thread queues it between steps; the loop never waits
            return stream
        except ValueError as exc:  # the engine's own checks: token ids outside the vocabulary, ...
            raise APIError(400, str(exc), param=param) from None
        except QueueFullError as exc:
            raise APIError(503, str(exc), "server_busy", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "server_error") from None
