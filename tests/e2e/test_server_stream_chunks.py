"""Streams as OpenAI's and vLLM's: a chat stream opens with `delta: {"role": "assistant", "content": ""}`, the
usage comes only with `stream_options: {"include_usage": true}`, as a last chunk of its own with `choices: []`,
and token ids only with vLLM's `return_token_ids: true`."""
from __future__ import annotations

import json

import pytest
from _server_utils import KEY, MODEL, H, tiny_engine
from fastapi.testclient import TestClient

from lab_utils.server.app import create_app

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True,
        "temperature": 0, "stream": True}
TEXT = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 5, "ignore_eos": True, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app(tiny_engine(), MODEL, max_tokens_cap=16, api_key=KEY))


def _events(client, path, body) -> list[dict]:
    with client.stream("POST", path, headers=H, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)
    return [json.loads(x[6:]) for x in lines[:-1]]


def test_a_chat_stream_opens_with_the_role_and_has_no_usage_or_ids_unless_asked(client):
    events = _events(client, "/v1/chat/completions", CHAT)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[0]["object"] == "chat.completion.chunk" and events[0]["choices"][0]["finish_reason"] is None
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:])
    assert len(events) == 1 + 5 and events[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in e and "token_ids" not in e["choices"][0] for e in events)
    assert all("prompt_token_ids" not in e for e in events)


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)])
def test_include_usage_adds_a_last_chunk_without_choices(client, path, body):
    plain = client.post(path, headers=H, json={**body, "stream": False}).json()
    events = _events(client, path, {**body, "stream_options": {"include_usage": True}})
    last = events[-1]
    assert last["choices"] == [] and set(last["usage"]) == set(plain["usage"]), last
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (cached_tokens: the stream finds plain's prefix)
    assert [last["usage"][k] for k in counts] == [plain["usage"][k] for k in counts]
    assert last["usage"]["completion_tokens"] == 5
    assert all(e["usage"] is None for e in events[:-1])  # OpenAI: null on every other chunk
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    text = "".join(e["choices"][0]["delta" if "chat" in path else "text"].get("content", "") if "chat" in path
                   else e["choices"][0]["text"] for e in events[:-1])
    want = plain["choices"][0]["message"]["content"] if "chat" in path else plain["choices"][0]["text"]
    assert text == want


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)])
def test_return_token_ids_gives_the_ids_streamed_and_not(client, path, body):
    plain = client.post(path, headers=H, json={**body, "stream": False, "return_token_ids": True}).json()
    choice = plain["choices"][0]
    assert len(choice["token_ids"]) == 5
    prompt_ids = plain["prompt_token_ids"] if "chat" in path else choice["prompt_token_ids"]
    assert len(prompt_ids) == plain["usage"]["prompt_tokens"]
    if "chat" not in path:
        assert prompt_ids == [5, 6, 7]
    events = _events(client, path, {**body, "return_token_ids": True})
    streamed = [t for e in events for t in e["choices"][0].get("token_ids", [])]
    assert streamed == choice["token_ids"]  # temperature 0: the same tokens
    first = events[0] if "chat" in path else events[0]["choices"][0]
    assert first["prompt_token_ids"] == prompt_ids
    plain_no_ids = client.post(path, headers=H, json={**body, "stream": False}).json()
    assert "token_ids" not in plain_no_ids["choices"][0] and "prompt_token_ids" not in plain_no_ids


@pytest.mark.parametrize("body,param", [({**TEXT, "stream": False, "stream_options": {"include_usage": True}},
                                         "stream_options"),
                                        ({**TEXT, "stream_options": {"continuous_usage_stats": True}},
                                         "stream_options.continuous_usage_stats")])
def test_stream_options_that_cannot_be_honoured_are_a_400(client, body, param):
    r = client.post("/v1/completions", headers=H, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text

