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
