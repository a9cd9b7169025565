"""Every error is OpenAI's error object (`code` a string or null, `param` the field or null), and no OpenAI field
is accepted and ignored: one the server does not implement is a 400 naming it, unless its value asks for
nothing (`logprobs: false`, `frequency_penalty: 0`, ...)."""
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


@pytest.mark.parametrize("field,value", [
    ("logprobs", 3), ("echo", True), ("logit_bias", {"5": 100}), ("logit_bias", {"999999999": "nan"}),
    ("frequency_penalty", 0.5), ("presence_penalty", -1), ("repetition_penalty", 1.2), ("min_tokens", 5),
    ("best_of", 2), ("suffix", "x"), ("top_logprobs", 2),
])
def test_a_field_not_implemented_is_a_400_naming_it(client, field, value):
    for path, body in (("/v1/completions", BASE), ("/v1/chat/completions", CHAT)):
        r = client.post(path, headers=H, json={**body, field: value})
        assert r.status_code == 400, r.text
        err = _is_error_object(r.json())
        assert err["param"] == field and "not supported" in err["message"]


def test_values_that_ask_for_nothing_are_accepted(client):
    neutral = {"logprobs": False, "echo": False, "logit_bias": {}, "frequency_penalty": 0, "presence_penalty": 0.0,
               "repetition_penalty": 1, "min_tokens": 0, "best_of": 1, "suffix": "", "top_logprobs": 0}
    r = client.post("/v1/completions", headers=H, json={**BASE, **neutral})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


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
