"""One generation request's answer, in OpenAI's shapes: a whole body, or server-sent event chunks.

`complete` queues the checked request and answers it: a stream (`sse`: the chunks' text adds up to the body's
text) or, once the request ends, one JSON body. A completion with several prompts, or `n` > 1, is one engine
request per choice, `index` = prompt index * n + i as in OpenAI's and vLLM's answers (with a seed, choice i
samples with seed + i, as vLLM's); their chunks interleave in a stream, and the usage is their sum. A client that leaves first has its requests aborted at once, so their KV
blocks go back to the pool, streamed or not.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from lab_utils.engine.request import RequestOutput
from lab_utils.engine.sampling_params import SEED_RANGE, SamplingParams
from lab_utils.server.async_engine import EngineDeadError, Stream
from lab_utils.server.errors import APIError
from lab_utils.server.frontend import Frontend, grammar_param
from lab_utils.server.logprobs import StreamLogprobs, TokenTexts, chat_logprobs, completion_logprobs
from lab_utils.server.schemas import CommonFields
from lab_utils.server.stream_text import StreamText
from lab_utils.server.streaming import DONE, openai_framing
from lab_utils.server.tools import Tool, chat_reply
from lab_utils.structured.hook import DEAD_END


async def complete(fe: Frontend, raw: Request, prompts: list[list[int]], params: SamplingParams, kind: str,
                   req: CommonFields, param: str, mode: str | None = None, tools: list[Tool] | None = None,
                   echo: list[str] | None = None, n: int = 1):
    """`prompts` the token ids of each prompt (chat: one; a completion: n choices per prompt); `kind` "chat" or
    "text"; `param` the field the prompts came from (named by its errors); `mode` the tool mode
    (tools.tool_mode); `echo`: each prompt's text, put before its completions (their logprobs too, if asked)."""
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    echoes = [e for e in echo or [None] * len(prompts) for _ in range(n)]
    prompts = [ids for ids in prompts for _ in range(n)]  # choice k: prompt k // n, sample k % n
    handles = await submit_all(fe, prompts, [nth_sample(params, k % n) for k in range(len(prompts))], param, n)
    rid, created = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:16]}", int(time.time())
    grammar = grammar_param(mode) if params.structured_output is not None else None
    if req.stream:
        chunks = [Chunks(fe, kind, rid, created, params.stop, grammar, e, req, ids, mode, tools, index=i)
                  for i, (ids, e) in enumerate(zip(prompts, echoes))]
        return StreamingResponse(sse(fe, handles, chunks), media_type="text/event-stream")
    finals = await until_done_or_gone(fe, raw, handles)
    if finals is None:  # the client left: its requests were aborted, their KV blocks are free
        return Response(status_code=499)
    for i, final in enumerate(finals):
        where = f"{param}[{i // n}]: " if len(finals) > n else ""
        if final.finish_reason == DEAD_END:
            raise APIError(400, f"{where}{grammar}: {final.finish_reason}", param=grammar, code="grammar_dead_end")
        if final.finish_reason and final.finish_reason.startswith("error"):
            raise APIError(500, where + final.finish_reason, "server_error")
        if final.finish_reason and final.finish_reason.startswith("rejected"):
            raise APIError(400, where + final.finish_reason, param=param)
    body = {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
            "model": fe.model_name, "choices": [], "usage": usage_sum(finals)}
    for i, (final, e) in enumerate(zip(finals, echoes)):
        if kind == "chat":
            message, finish = chat_reply(final.text, mode, tools, finish_reason(final.finish_reason))  # tool_calls
            choice = {"index": i, "message": message, "finish_reason": finish,
                      "logprobs": None if final.logprobs is None else chat_logprobs(final.logprobs, fe.token_texts)}
        else:
            choice = {"index": i, "text": (e or "") + final.text, "finish_reason": finish_reason(final.finish_reason),
                      "logprobs": completion_choice_logprobs(final, e is not None, fe.token_texts)}
        if req.return_token_ids:  # vLLM's places: the prompt's ids on the response (chat) or the choice
            choice["token_ids"] = list(final.token_ids)
            (body if kind == "chat" else choice)["prompt_token_ids"] = list(final.prompt_token_ids)
        body["choices"].append(choice)
    return body


def nth_sample(params: SamplingParams, i: int) -> SamplingParams:
    """The params of a prompt's choice i: its own seed, seed + i (vLLM's rule; wrapped into int64)."""
    if i == 0 or params.seed is None:
        return params
    lo, span = SEED_RANGE[0], SEED_RANGE[1] - SEED_RANGE[0] + 1
    return dataclasses.replace(params, seed=(params.seed + i - lo) % span + lo)


async def submit_all(fe: Frontend, prompts: list[list[int]], params: list[SamplingParams], param: str,
                     n: int = 1) -> list[Stream]:
    """Queue one engine request per choice; if any is refused, those already queued are aborted and the refusal
    names the prompt (`prompt[1]: ...`) when there are several."""
    handles: list[Stream] = []
    try:
        for ids, p in zip(prompts, params):
            handles.append(await fe.submit(ids, p, param))
    except BaseException as exc:
        for h in handles:
            fe.aengine.abort(h.request_id)
        if isinstance(exc, APIError) and len(prompts) > n:
            exc.message = f"{param}[{len(handles) // n}]: {exc.message}"
        raise
    return handles


class Chunks:
    """One stream's chunks in OpenAI's format. A chat stream starts with the role chunk (`first`); the usage comes
    as a last chunk of its own (`usage_chunk`) when `stream_options.include_usage` asks for it; token ids come
    when `return_token_ids` asks for them. With tools in play, the reply is sent whole in the last chunk, as
    `delta.tool_calls` or `delta.content` (which it is shows only at its end)."""

    def __init__(self, fe: Frontend, kind: str, rid: str, created: int, stops: list[str], grammar: str | None,
                 echo: str | None = None, req: CommonFields | None = None, prompt_ids: list[int] | None = None,
                 mode: str | None = None, tools: list[Tool] | None = None, index: int = 0) -> None:
        self.kind, self.rid, self.created, self.model_name = kind, rid, created, fe.model_name
        self.index = index  # the choice's index: its prompt's place in the request
        self.grammar, self.prompt_ids, self.mode, self.tools = grammar, prompt_ids, mode, tools
        self.include_usage = bool(req and req.stream_options and req.stream_options.include_usage)
        self.with_ids = bool(req and req.return_token_ids)
        self.text = StreamText(fe.tokenizer, stops)
        self.obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self.logprobs = StreamLogprobs(fe.token_texts, kind, echo)  # each chunk's; the echoed prompt on the first
        self.prompt_ids_sent = False  # a completion's first chunk carries the prompt's ids
        self.final_usage: dict | None = None  # set by the last output

    def head(self, **fields) -> dict:
        return {"id": self.rid, "object": self.obj, "created": self.created, "model": self.model_name, **fields}

    def first(self) -> dict | None:
        """A chat stream's role chunk, sent before the first output's (None for a completion)."""
        if self.kind != "chat":
            return None
        first = self.head(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}])
        if self.with_ids:
            first["prompt_token_ids"] = self.prompt_ids
        if self.include_usage:
            first["usage"] = None
        return first

    def to_chunk(self, out: RequestOutput) -> dict:
        """One engine output as a chunk, or as the error object of a request that failed."""
        kind = self.kind
        if out.finished and out.finish_reason == DEAD_END:
            return {"error": {"message": out.finish_reason, "type": "invalid_request_error",
                              "param": self.grammar, "code": "grammar_dead_end"}}
        if out.finished and out.finish_reason and out.finish_reason.startswith("error"):
            return {"error": {"message": out.finish_reason, "type": "server_error", "param": None, "code": None}}
        delta = self.text.delta(out.new_token_ids)
        if out.finished:
            delta += self.text.final(out.text)
        prefix, logprobs = self.logprobs.take(out)
        delta = prefix + delta
        if kind == "chat":
            choice = {"index": self.index, "delta": {"content": delta}, "finish_reason": None}
        else:
            choice = {"index": self.index, "text": delta, "finish_reason": None}
        if self.with_ids:  # vLLM's return_token_ids: exact token accounting
            if kind != "chat" and not self.prompt_ids_sent:  # a completion's first chunk
                choice["prompt_token_ids"] = self.prompt_ids
                self.prompt_ids_sent = True
            choice["token_ids"] = out.new_token_ids
        choice["logprobs"] = logprobs
        if out.finished:
            choice["finish_reason"] = finish_reason(out.finish_reason)
        if kind == "chat" and self.mode is not None:  # tools: content or tool calls, known once the reply is whole
            choice["delta"] = {}
            if out.finished:
                message, choice["finish_reason"] = chat_reply(out.text, self.mode, self.tools,
                                                              finish_reason(out.finish_reason))
                calls = message.get("tool_calls")
                choice["delta"] = ({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]} if calls
                                   else {"content": message["content"]})
        chunk = self.head(choices=[choice])
        if self.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        if out.finished:
            self.final_usage = usage(out)
        return chunk



def usage_chunk(chunks: list[Chunks]) -> dict | None:
    """The stream's last chunk: the usage of all its choices summed, when asked for and every choice ended."""
    if chunks[0].include_usage and all(c.final_usage is not None for c in chunks):
        return chunks[0].head(choices=[], usage=add_usages([c.final_usage for c in chunks]))
    return None


async def sse(fe: Frontend, streams: list[Stream], chunks: list[Chunks]):
    """SSE lines from the streaming loop (`streaming.stream_sse`, or the learner's; one per prompt, their lines
    merged), framed as OpenAI's. An engine that died, or a learner's loop that raised, ends the stream with an
    error chunk and [DONE]."""
    loops = [fe.stream_fn(fe.aengine.outputs(s, abort_on_exit=False), c.to_chunk,
                          lambda rid=s.request_id: fe.aengine.abort(rid)) for s, c in zip(streams, chunks)]
    try:
        async for line in openai_framing(loops[0] if len(loops) == 1 else merge_streams(loops), chunks[0].first(),
                                         lambda: usage_chunk(chunks)):
            yield line
    except EngineDeadError as exc:
        yield server_error_event(str(exc))
        yield "data: [DONE]\n\n"
    except Exception as exc:  # a learner's loop that raised: the client is told, the requests are ended
        for s in streams:
            fe.aengine.abort(s.request_id)
        why = f"the streaming loop ({fe.stream_parts or 'reference'}) raised {type(exc).__name__}: {exc}"
        yield server_error_event(why)
        yield "data: [DONE]\n\n"


def server_error_event(message: str) -> str:
    error = {"message": message, "type": "server_error", "param": None, "code": None}
    return f"data: {json.dumps({'error': error})}\n\n"


async def merge_streams(loops: list) -> AsyncIterator[str]:
    """The SSE lines of several streaming loops as each comes, each loop's [DONE] held back: one [DONE] after the
    last. Left early (the client went), every loop still running is cancelled, so each aborts its request."""
    pending = {asyncio.ensure_future(anext(loop)): loop for loop in loops}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                loop = pending.pop(task)
                try:
                    line = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(loop))] = loop
                if line != DONE:
                    yield line
        yield DONE
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for loop in loops:
            await loop.aclose()


async def until_done_or_gone(fe: Frontend, raw: Request, handles: list[Stream]) -> list[RequestOutput] | None:
    """Each request's last output, or None if the client disconnected first (then the requests are aborted
    at once: a non-streamed request's blocks go back as a stream's do)."""
    async def collect_one(handle: Stream):
        final = None
        async for out in fe.aengine.outputs(handle):
            final = out
        return final

    def collect():
        return asyncio.gather(*(collect_one(h) for h in handles))

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
        for handle in handles:
            fe.aengine.abort(handle.request_id)
        return None
    try:
        return work.result()
    except EngineDeadError as exc:
        raise APIError(500, str(exc), "server_error") from None


def completion_choice_logprobs(out: RequestOutput, echo: bool, token_texts: TokenTexts) -> dict | None:
    if out.logprobs is None:
        return None
    ids, entries = list(out.token_ids), list(out.logprobs)
    if echo:
        ids, entries = out.prompt_token_ids + ids, out.prompt_logprobs + entries
    return completion_logprobs(ids, entries, token_texts)[0]


def finish_reason(reason: str | None) -> str | None:
    """The engine's finish reason as OpenAI's: "length", "stop", or the reason's kind ("abort", "error", ...)."""
    if reason is None:
        return None
    return "length" if reason == "length" else "stop" if reason == "stop" else reason.split(":")[0]


def add_usages(usages: list[dict]) -> dict:
    """Several choices' usage as one (OpenAI's usage of a request with several prompts: their sum)."""
    total = {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    total["prompt_tokens_details"] = {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"]
                                                           for u in usages)}
    return total


def usage_sum(outs: list[RequestOutput]) -> dict:
    return add_usages([usage(o) for o in outs])


def usage(out: RequestOutput) -> dict:
    """OpenAI's usage, with the prompt tokens the prefix cache served (`prompt_tokens_details.cached_tokens`,
    whole KV blocks: a multiple of the block size) so a client can tell computed prefill from reused."""
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}
