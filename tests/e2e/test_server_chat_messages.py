"""Chat messages as real clients send them: every role (system, developer, user, assistant with tool_calls and
content null, tool with tool_call_id), content as text parts, OpenAI's conversation rules for tool messages,
and a full tool round trip through the official `openai` client."""
from __future__ import annotations

import json

import httpx
import pytest
from _server_utils import KEY, MODEL, H, UvicornThread, tiny_engine

from lab_utils.server.app import create_app
from lab_utils.server.messages import for_template
from lab_utils.server.schemas import ChatRequest
from lab_utils.server.tools import render_chat

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
                   "additionalProperties": False}}}
FORECAST = {"Paris": "sunny, 21 C", "Oslo": "snow, -4 C"}


@pytest.fixture(scope="module")
def server():
    engine = tiny_engine()
    app = create_app(engine, MODEL, max_tokens_cap=64, api_key=KEY)
    with UvicornThread(app) as srv:
        srv.engine = engine
        yield srv


def _chat(server, messages, **kw):
    return httpx.post(server.url + "/v1/chat/completions", headers=H, timeout=60,
                      json={"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, **kw})


def _prompt_tokens(server, messages, tools=None, tool_choice=None) -> int:
    """Tokens of the prompt the server renders for these messages (what the model reads)."""
    req = ChatRequest(model=MODEL, messages=messages, tools=tools, tool_choice=tool_choice)
    mode = None if not tools or tool_choice == "none" else "auto" if tool_choice in (None, "auto") else "required"
    text = render_chat(server.engine.tokenizer, for_template(req.messages), req.tools, mode)
    return len(server.engine.tokenizer(text, add_special_tokens=False).input_ids)


def test_a_tool_round_trip_through_the_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    messages = [{"role": "developer", "content": "Answer with the weather tool."},
                {"role": "user", "content": [{"type": "text", "text": "What is the weather in Paris?"}]}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=40, temperature=0)
    assert first.choices[0].finish_reason == "tool_calls", first
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and first.choices[0].message.content is None
    args = json.loads(call.function.arguments)
    assert args["city"] in FORECAST  # the schema held
    # the client runs the tool and sends the assistant's message back with the result
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": FORECAST[args["city"]]}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8,
                                            temperature=0)
    assert second.choices[0].message.role == "assistant"
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the model read the call and the result: the server's prompt holds them
    sent = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
    prompt = render_chat(server.engine.tokenizer, for_template(ChatRequest(model=MODEL, messages=sent).messages),
                         ChatRequest(model=MODEL, messages=sent, tools=[WEATHER]).tools, "auto")
    assert FORECAST[args["city"]] in prompt and call.function.name in prompt and "Paris?" in prompt
    assert second.usage.prompt_tokens == _prompt_tokens(server, sent, [WEATHER])
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_a_named_tool_choice_answers_with_that_tool(server):
    r = _chat(server, [{"role": "user", "content": "Oslo?"}], tools=[WEATHER], max_tokens=30,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.status_code == 200, r.text
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["city"] in FORECAST


def test_developer_and_text_parts_read_as_system_and_string(server):
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere"}]
    a, b = _chat(server, parts), _chat(server, plain)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    counts = ("prompt_tokens", "completion_tokens")  # (the second request finds the first's prefix cached)
    assert [a.json()["usage"][k] for k in counts] == [b.json()["usage"][k] for k in counts]
    assert a.json()["choices"][0]["message"]["content"] == b.json()["choices"][0]["message"]["content"]


def test_a_conversation_with_several_calls_and_content(server):
    calls = [{"id": f"call_{c}", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}} for c in FORECAST]
    msgs = [{"role": "system", "content": "You know the weather."}, {"role": "user", "content": "Paris and Oslo?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
            *({"role": "tool", "tool_call_id": f"call_{c}", "content": w} for c, w in FORECAST.items()),
            {"role": "assistant", "content": "Sunny in Paris, snow in Oslo."}, {"role": "user", "content": "Thanks"}]
    r = _chat(server, msgs, tools=[WEATHER])
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == _prompt_tokens(server, msgs, [WEATHER])
    r = _chat(server, msgs)  # no tools offered now: the history still renders
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("content,kind", [([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}], "image_url"),
                                          ([{"type": "text", "text": "a"}, {"type": "input_audio"}], "input_audio")])
def test_a_part_that_is_not_text_is_a_400_naming_it(server, content, kind):
    r = _chat(server, [{"role": "user", "content": content}])
    assert r.status_code == 400
    err = r.json()["error"]
    assert kind in err["message"] and err["param"] == "messages.0.content", err


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
ASK = {"role": "user", "content": "Oslo?"}


@pytest.mark.parametrize("messages,param", [
    ([ASK, {"role": "tool", "tool_call_id": "call_1", "content": "snow"}], "messages.1.role"),
    ([ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]}], "messages.1.tool_calls"),
    ([ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "call_2", "content": "snow"}], "messages.2.tool_call_id"),
    ([ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]}, ASK], "messages.2"),
    ([ASK, {"role": "assistant", "content": None}], "messages.1"),
    ([ASK, {"role": "tool", "content": "snow"}], "messages.1.tool_call_id"),
    ([{"role": "wizard", "content": "x"}], "messages.0"),
])
def test_conversations_openai_refuses_are_a_400_naming_the_message(server, messages, param):
    r = _chat(server, messages)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


@pytest.mark.parametrize("extra", [{"tools": [WEATHER], "tool_choice": "required"},
                                   {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                                         "function": {"name": "get_weather"}}},
                                   {"response_format": {"type": "json_object"}}])
def test_a_stop_string_with_a_json_constraint_is_a_400(server, extra):
    """A stop string could end the JSON half-written (a tool call whose arguments do not parse)."""
    r = _chat(server, [ASK], stop=['"'], **extra)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}, "auto"])
def test_streamed_tool_calls_match_the_whole_reply(server, tool_choice):
    """With tools, a stream carries the reply whole in its last chunk: the same tool calls (or content) as the
    non-streamed reply, assembled by the openai client from `delta.tool_calls`."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    kw = dict(model=MODEL, messages=[ASK], tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=False,
              max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    assert tool_choice == "auto" or whole.message.tool_calls, whole  # a forced call fits in 40 tokens
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])]
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    if whole.message.tool_calls:
        assert [(c.function.name, c.function.arguments) for c in calls] == \
            [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert all(c.id and c.type == "function" for c in calls) and [c.index for c in calls] == list(range(len(calls)))
    else:
        assert tool_choice == "auto" and content == whole.message.content and not calls
