"""`openai_framing`: the role chunk goes just before the first event that is not an error, the usage chunk just
before [DONE], and leaving early closes the streaming loop (its abort runs)."""
from __future__ import annotations

import asyncio
import json

from lab_utils.server.streaming import DONE, openai_framing

ROLE = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
USAGE = {"choices": [], "usage": {"completion_tokens": 2}}


def _ev(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _run(lines, first=ROLE, usage=lambda: USAGE, take=None):
    closed = []

    async def loop():
        try:
            for line in lines:
                await asyncio.sleep(0)
                yield line
        finally:
            closed.append(True)

    async def main():
        out, gen = [], openai_framing(loop(), first, usage)
        async for line in gen:
            out.append(line)
            if take is not None and len(out) == take:
                await gen.aclose()
                break
        return out

    return asyncio.run(main()), closed


def test_role_first_usage_last():
    a, b = _ev({"choices": [{"delta": {"content": "x"}}]}), _ev({"choices": [{"delta": {"content": "y"}}]})
    out, closed = _run([a, b, DONE])
    assert out == [_ev(ROLE), a, b, _ev(USAGE), DONE] and closed


def test_no_usage_unless_asked_and_no_role_for_completions():
    a = _ev({"choices": [{"text": "x"}]})
    assert _run([a, DONE], first=None, usage=lambda: None)[0] == [a, DONE]


def test_an_error_first_gets_no_role_chunk():
    err = _ev({"error": {"message": "dead end"}})
    assert _run([err, DONE], usage=lambda: None)[0] == [err, DONE]


def test_leaving_early_closes_the_loop():
    out, closed = _run([_ev({"choices": []})] * 5 + [DONE], take=2)
    assert len(out) == 2 and closed == [True]
