"""Every error is OpenAI's error object (`code` a string or null, `param` the field or null), and no OpenAI field
is accepted and ignored: one the server does not implement is a 400 naming it, unless its value asks for
nothing (`best_of: 1`, `suffix: ""`, ...)."""
from __future__ import annotations

import pytest
from _server_utils import KEY, MODEL, H, tiny_engine
from fastapi.testclient import TestClient

from lab_utils.server.app import create_app

BASE = {"model": MODEL, "prompt": [5, 6], "max_tokens": 2, "ignore_eos": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app(tiny_engine(), MODEL, max_tokens_cap=8, api_key=KEY))


def _is_error_object(body: dict) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["code"] is None or isinstance(err["code"], str), err
    assert err["param"] is None or (isinstance(err["param"], str) and err["param"]), err
    return err


@pytest.mark.parametrize("path,field,value", [
    *[(path, field, value) for path in ("/v1/completions", "/v1/chat/completions")
      for field, value in (("best_of", 2), ("suffix", "x"))],
    ("/v1/completions", "top_logprobs", 2),  # chat's field; here `logprobs` is the count
    ("/v1/chat/completions", "echo", True),  # a completions field
])
def test_a_field_not_implemented_is_a_400_naming_it(client, path, field, value):
    r = client.post(path, headers=H, json={**(BASE if path == "/v1/completions" else CHAT), field: value})
    assert r.status_code == 400, r.text
    err = _is_error_object(r.json())
    assert err["param"] == field and "not supported" in err["message"]


def test_values_that_ask_for_nothing_are_accepted(client):
    neutral = {"best_of": 1, "suffix": "", "top_logprobs": 0, "logit_bias": {}, "frequency_penalty": 0,
               "presence_penalty": 0.0, "repetition_penalty": 1, "min_tokens": 0}
    r = client.post("/v1/completions", headers=H, json={**BASE, **neutral, "echo": False})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    r = client.post("/v1/chat/completions", headers=H, json={**CHAT, **neutral, "echo": False, "logprobs": False})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text


def test_max_tokens_must_be_an_integer_not_a_boolean(client):
    r = client.post("/v1/completions", headers=H, json={**BASE, "max_tokens": True})
    assert r.status_code == 400 and _is_error_object(r.json())["param"] == "max_tokens"


@pytest.mark.parametrize("method,path,status", [("get", "/nope", 404), ("get", "/v1/completions", 405),
                                                ("delete", "/v1/models", 405)])
def test_404_and_405_are_error_objects(client, method, path, status):
    r = getattr(client, method)(path, headers=H)
    assert r.status_code == status
    assert path in _is_error_object(r.json())["message"]


def test_an_unparsable_body_is_an_error_object_without_a_param(client):
    r = client.post("/v1/completions", headers={**H, "content-type": "application/json"}, content=b"{not json")
    assert r.status_code == 400
    err = _is_error_object(r.json())
    assert err["param"] is None and "JSON" in err["message"]


def test_413_is_an_error_object(client):
    r = client.post("/v1/completions", headers=H, json={**BASE, "prompt": "x" * (2 << 20)})
    assert r.status_code == 413 and _is_error_object(r.json())["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,ctype", [(b"[1, 2]", "application/json"), (b"null", "application/json"),
                                        (b"", "application/json"), (b'{"model": "\xff"}', "application/json"),
                                        (b"[" * 100_000, "application/json"),
                                        (b'{"model": "tiny-random", "prompt": "x"}', "text/plain")])
def test_a_body_that_is_not_a_json_object_is_an_error_object(client, body, ctype):
    r = client.post("/v1/completions", headers={**H, "content-type": ctype}, content=body)
    assert r.status_code == 400, r.text
    err = _is_error_object(r.json())
    assert err["param"] is None and "JSON object" in err["message"], err


@pytest.mark.parametrize("field,value,param", [
    ("stop", [{"a": 1}], "stop"), ("tool_choice", 7, "tool_choice"),
    ("messages", [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": 1}}]}],
     "messages.0.tool_calls.0.function.name"),
    ("stream_options", {"include_usage": "maybe"}, "stream_options.include_usage"),
])
def test_param_names_the_field_not_pydantics_union_tags(client, field, value, param):
    r = client.post("/v1/chat/completions", headers=H, json={**CHAT, field: value})
    assert r.status_code == 400 and _is_error_object(r.json())["param"] == param, r.text


def test_a_server_bug_is_a_500_error_object_not_bare_text():
    engine = tiny_engine()
    app = create_app(engine, MODEL, max_tokens_cap=8)

    def broken(*_):
        raise RuntimeError("a bug")

    engine.check_request = broken
    r = TestClient(app, raise_server_exceptions=False).post("/v1/completions", json=BASE)
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    err = _is_error_object(r.json())
    assert err["type"] == "server_error" and "RuntimeError: a bug" in err["message"]


def test_options_is_a_405_error_object(client):
    r = client.options("/v1/chat/completions", headers=H)
    assert r.status_code == 405 and "OPTIONS" in _is_error_object(r.json())["message"]


def test_the_openapi_schema_describes_messages_and_errors(client):
    """/openapi.json lists the five message roles, the stream options, and OpenAI's error object for the error
    statuses (no FastAPI 422: a bad body is a 400); a real 400 body validates against that error schema."""
    from jsonschema import Draft202012Validator

    spec = client.get("/openapi.json").json()
    chat = spec["paths"]["/v1/chat/completions"]["post"]
    assert "422" not in chat["responses"] and {"400", "404", "413", "503"} <= set(chat["responses"])
    schemas = spec["components"]["schemas"]
    roles = schemas["ChatRequest"]["properties"]["messages"]["items"]["discriminator"]["mapping"]
    assert set(roles) == {"system", "developer", "user", "assistant", "tool"}
    assert "tool_call_id" in schemas["ToolMessage"]["required"]
    assert {"stream_options", "return_token_ids"} <= set(schemas["ChatRequest"]["properties"])
    r = client.post("/v1/chat/completions", headers=H, json={**CHAT, "messages": [{"role": "tool", "content": "x"}]})
    assert r.status_code == 400
    Draft202012Validator(schemas["ErrorResponse"]).validate(r.json())
