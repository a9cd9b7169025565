"""The server's `response_format` and `tools` / `tool_choice`, through the `openai` client (tiny random model:
the grammar makes its output valid whatever the weights)."""
from __future__ import annotations

import json

import httpx
import pytest
from _server_utils import KEY, MODEL, UvicornThread, tiny_engine

pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from lab_utils.server.app import create_app  # noqa: E402
from lab_utils.server.tools import Tool, parse_tool_calls  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["utc", "cet"]}},
                                       "required": ["tz"], "additionalProperties": False}}}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client():
    app = create_app(tiny_engine(), MODEL, max_tokens_cap=256, api_key=KEY)
    with UvicornThread(app) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)


def test_response_format_json_schema(client):
    out = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=200, temperature=0,
                                         response_format={"type": "json_schema", "json_schema": {
                                             "name": "person", "schema": PERSON}})
    text = out.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert out.choices[0].finish_reason == "stop"


def test_response_format_json_object_streamed(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=200, temperature=0,
                                                 stream=True, response_format={"type": "json_object"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish and (finish[-1] == "length" or isinstance(json.loads(text), dict)), text


def test_completions_accept_response_format(client):
    out = client.completions.create(model=MODEL, prompt="A person:", max_tokens=200, temperature=0,
                                    extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                        "name": "person", "schema": PERSON}}})
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)


def test_named_tool_choice_returns_a_tool_call(client):
    out = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=200, temperature=0,
                                         tools=[WEATHER, TIME],
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = out.choices[0].message
    assert msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_tool_choice_returns_tool_calls(client):
    out = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=250, temperature=0,
                                         tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    jsonschema.validate(json.loads(calls[0].function.arguments), schemas[calls[0].function.name])


def test_auto_tool_choice_answers_or_calls(client):
    out = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=12, temperature=0,
                                         tools=[WEATHER], tool_choice="auto")
    msg = out.choices[0].message
    assert (msg.tool_calls and out.choices[0].finish_reason == "tool_calls") or isinstance(msg.content, str)


def test_auto_tool_calls_are_parsed_like_hermes():
    tools = [Tool.model_validate(WEATHER)]
    calls = parse_tool_calls('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
                             '</tool_call>', tools)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    assert parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Rome"}}', tools)
    assert parse_tool_calls('{"name": "launch_rockets", "arguments": {}}', tools) == []
    assert parse_tool_calls("It is sunny.", tools) == []


@pytest.mark.parametrize("kwargs,needle", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "frob"}}}),
     "frob"),
    (dict(response_format={"type": "json_schema"}), "json_schema"),
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "nope"),
    (dict(tool_choice="required"), "tools"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
])
def test_invalid_structured_requests_get_a_400_naming_the_problem(client, kwargs, needle):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, **kwargs)
    assert needle in str(err.value)


def test_server_still_serves_after_bad_schemas(client):
    r = httpx.get(str(client.base_url).removesuffix("/v1/") + "/health")
    assert r.json() == {"status": "ok"}


ANIMAL = {"$defs": {"named": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
                              "required": ["name"]}},
          "allOf": [{"$ref": "#/$defs/named"},
                    {"oneOf": [{"properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 9}},
                                "required": ["kind", "lives"]},
                               {"properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
                                "required": ["kind", "good"]}]}]}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_all_of_and_one_of_are_served_and_validate(client, temperature):
    """allOf merged into one schema, a oneOf of disjoint branches (a const discriminator) as their anyOf: every
    output validates against the schema as sent."""
    for seed in range(3 if temperature else 1):
        out = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=120, temperature=temperature,
                                             seed=seed, response_format={"type": "json_schema", "json_schema": {
                                                 "name": "animal", "schema": ANIMAL}})
        assert out.choices[0].finish_reason == "stop", out
        jsonschema.validate(json.loads(out.choices[0].message.content), ANIMAL)


@pytest.mark.parametrize("schema,words", [
    ({"oneOf": [{"type": "integer"}, {"minimum": 2}]}, "oneOf branches 0 and 1 may both match"),
    ({"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]}, "'pattern' differently"),
])
def test_one_of_that_may_overlap_and_all_of_that_cannot_merge_are_a_precise_400(client, schema, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=20, response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    error = info.value.body
    assert error["param"] == "response_format" and words in error["message"], error
