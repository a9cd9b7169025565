"""The OpenAI-compatible server on loopback: protocol, bad input, load, disconnects (bounded in count and time)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from _server_utils import MODEL, UvicornThread, tiny_engine, wait_idle

from lab_utils.server.app import create_app


@pytest.fixture(scope="module")
def server():
    engine = tiny_engine()
    app = create_app(engine, MODEL, max_tokens_cap=64, api_key="sk-test")
    with UvicornThread(app) as srv:
        srv.engine = engine
        yield srv


H = {"Authorization": "Bearer sk-test"}


def test_models_health_metrics(server):
    r = httpx.get(server.url + "/v1/models", headers=H)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    httpx.post(server.url + "/v1/completions", headers=H, json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    text = httpx.get(server.url + "/metrics").text
    for name in ("lab:time_to_first_token_seconds", "lab:inter_token_latency_seconds",
                 "lab:e2e_request_latency_seconds", "lab:kv_cache_usage_perc", "lab:num_requests_running",
                 "lab:num_requests_waiting", "lab:num_preemptions"):
        assert name in text, f"{name} missing from /metrics"


def test_completion_and_chat_non_streaming(server):
    r = httpx.post(server.url + "/v1/completions", headers=H,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    body = r.json()
    assert r.status_code == 200, body
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"
    r = httpx.post(server.url + "/v1/chat/completions", headers=H,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                         "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


def test_openai_client_streams_chat(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test")
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=6, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len(chunks) == 1 + 6  # the role chunk, then one per token
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


@pytest.mark.parametrize("case,status", [
    ("no_key", 401), ("wrong_model", 404), ("bad_json", 400), ("bad_field", 400), ("too_long", 400),
    ("missing_field", 400), ("empty_messages", 400),
])
def test_bad_requests(server, case, status):
    url, body, headers = server.url + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}, dict(H)
    content = None
    if case == "no_key":
        headers = {}
    elif case == "wrong_model":
        body["model"] = "gpt-9"
    elif case == "bad_json":
        content, body = b"{not json", None
        headers["content-type"] = "application/json"
    elif case == "bad_field":
        body["temperature"] = -3
    elif case == "too_long":
        body["prompt"] = list(range(100, 100 + server.engine.max_model_len + 5))
    elif case == "missing_field":
        del body["prompt"]
    elif case == "empty_messages":
        url, body = server.url + "/v1/chat/completions", {"model": MODEL, "messages": []}
    r = httpx.post(url, headers=headers, json=body, content=content) if content is None else \
        httpx.post(url, headers=headers, content=content)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"], "an error must say what is wrong"


def test_max_tokens_is_capped(server):
    r = httpx.post(server.url + "/v1/completions", headers=H,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 10_000, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 64


async def _stream_tokens(client: httpx.AsyncClient, url: str, n: int, stop_after: int | None = None) -> int:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": n, "stream": True, "ignore_eos": True,
            "temperature": 0}
    got = 0
    async with client.stream("POST", url + "/v1/completions", json=body, headers=H) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                json.loads(line[6:])
                got += 1
                if stop_after is not None and got >= stop_after:
                    return got  # leaving the block closes the connection mid-stream
    return got


def test_200_concurrent_streams_all_complete(server):
    async def main():
        limits = httpx.Limits(max_connections=256)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.wait_for(
                asyncio.gather(*[_stream_tokens(client, server.url, 8) for _ in range(200)]), timeout=240)

    counts = asyncio.run(main())
    assert counts == [8] * 200, f"{sum(c != 8 for c in counts)} of 200 streams lost tokens"
    wait_idle(server.engine)


def test_disconnects_free_every_block(server):
    """Clients that leave after 3 tokens: each request ends (aborted, or finished if the engine got to token 64
    before the server noticed the disconnect; the tiny model is that fast), none is lost, every block returns."""
    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.wait_for(
                asyncio.gather(*[_stream_tokens(client, server.url, 64, stop_after=3) for _ in range(20)]), timeout=120)

    wait_idle(server.engine)
    before = server.engine.stats()
    assert asyncio.run(main()) == [3] * 20
    wait_idle(server.engine)
    after = server.engine.stats()
    aborted = after["num_aborted"] - before["num_aborted"]
    finished = after["num_finished"] - before["num_finished"]
    assert aborted + finished == 20, f"{20 - aborted - finished} of 20 disconnected requests never ended"
    assert aborted >= 1, "no disconnect aborted its request: every one ran to max_tokens"
    server.engine.block_manager.check_all_free()
