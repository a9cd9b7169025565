"""The server's streaming loop: one request's engine outputs -> server-sent events, aborted when the client goes.

`stream_sse(outputs, to_chunk, abort)` is what a streaming response iterates. It writes one SSE event per engine
output (`data: <json>` and a blank line: the event's end), ends the stream with `data: [DONE]` (OpenAI's and
vLLM's end marker), and, when it is left before the request finished (the client disconnected: Starlette
cancels the response, which raises CancelledError inside this generator or closes it with GeneratorExit), calls
`abort()`, which ends the request in the engine and frees its KV blocks at once. Without that, a request whose
client has gone keeps decoding to max_tokens and keeps its blocks all the while.

It is a part the learner rewrites in lab 12 (`server.stream_sse`); `load_stream_part` gives the server the
learner's saved version. `openai_framing` adds what OpenAI's streams carry around the loop's events: a chat
stream's first chunk (`delta: {"role": "assistant", "content": ""}`), sent with the first event so a client's
time to first token still measures the first token, and, when the request asked for it
(`stream_options: {"include_usage": true}`), a last chunk with the usage and `choices: []` before `[DONE]`.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel, ConfigDict, Field

STREAM_PART = "server.stream_sse"


async def stream_sse(outputs: AsyncIterator, to_chunk: Callable[[object], dict],
                     abort: Callable[[], None]) -> AsyncIterator[str]:
    """SSE lines for one request: `outputs` its RequestOutputs as the engine makes them, `to_chunk(out)` the JSON
    object of one (OpenAI's chunk, or {"error": ...} for a failed request), `abort()` ends it in the engine."""
    finished = False
    try:
        async for out in outputs:
            yield f"data: {json.dumps(to_chunk(out))}\n\n"
            if out.finished:
                finished = True
                break
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client left (or the loop failed): free the request's blocks now
            abort()


class StreamOptions(BaseModel):
    """OpenAI's `stream_options` (only with `stream: true`)."""
    model_config = ConfigDict(extra="forbid", strict=True)  # an option this server does not implement is a 400, not ignored
    include_usage: bool = Field(default=False, description="a last chunk with the usage and choices: [] before "
                                                           "[DONE]; the other chunks carry usage: null")


DONE = "data: [DONE]\n\n"


async def openai_framing(lines: AsyncIterator[str], first: dict | None,
                         usage: Callable[[], dict | None]) -> AsyncIterator[str]:
    """`lines` (the streaming loop's events) with `first` sent just before the first event that is not an error,
    and the chunk `usage()` returns (None: none) sent just before `[DONE]`."""
    try:
        async for line in lines:
            if first is not None:
                if not line.startswith('data: {"error"'):  # an error is the stream's only news: no role chunk
                    yield f"data: {json.dumps(first)}\n\n"
                first = None
            if line == DONE:
                last = usage()
                if last is not None:
                    yield f"data: {json.dumps(last)}\n\n"
            yield line
    finally:
        close = getattr(lines, "aclose", None)  # left early (the client went): the loop's own exit runs now
        if close is not None:
            await close()


def load_stream_part(names=()) -> tuple[Callable, list[str]]:
    """(the streaming loop the server runs, [STREAM_PART] when it is the learner's): the learner's saved version
    (from my_engine/server.py, `LAB_LEARNER_DIR`) when `names` asks for it, else the reference."""
    from lab_utils.course import learner_parts

    names = list(names)
    unknown = [n for n in names if n != STREAM_PART]
    if unknown:
        raise ValueError(f"learner_parts: {unknown} are not server parts; the server's part is {STREAM_PART!r}")
    if not names:
        return stream_sse, []
    fn = learner_parts.load_part(STREAM_PART)
    if fn is None:
        raise ValueError(f"learner_parts asks for your {STREAM_PART}, but {learner_parts.learner_dir()} has none: run the "
                         f"lab's check cell (it saves your function with learner_parts.submit)")
    return fn, [STREAM_PART]
