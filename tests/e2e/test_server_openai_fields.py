"""No field of the official `openai` client is silently dropped: every parameter of `completions.create()` and
`chat.completions.create()` is a field of the server's request model (served, or refused with a 400 naming it
unless its value asks for nothing), or one of the client's own transport options."""
from __future__ import annotations

import inspect

import pytest
from _server_utils import KEY, MODEL, H, tiny_engine
from fastapi.testclient import TestClient

from lab_utils.server.app import create_app
from lab_utils.server.schemas import ChatRequest, CompletionRequest, _refuse

openai = pytest.importorskip("openai")
from openai.resources.chat.completions import Completions as ChatCompletions  # noqa: E402
from openai.resources.completions import Completions  # noqa: E402

CLIENT_SIDE = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}  # never sent as body fields
BASE = {"model": MODEL, "prompt": [5, 6], "max_tokens": 2, "ignore_eos": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ENDPOINTS = [(Completions, CompletionRequest, "/v1/completions", BASE),
             (ChatCompletions, ChatRequest, "/v1/chat/completions", CHAT)]
# a value of each refused field that asks for something
ASKING = {"functions": [{"name": "f", "parameters": {"type": "object"}}], "function_call": "auto",
          "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"},
          "prediction": {"type": "content", "content": "x"}, "web_search_options": {}, "service_tier": "flex",
          "reasoning_effort": "high", "store": True, "verbosity": "low", "moderation": {"model": "m"},
          "prompt_cache_options": {}, "prompt_cache_retention": "24h"}


def _refused(model, field: str) -> bool:
    """Is `field` one of the model's refused-unless-neutral fields (its validator is schemas._refuse)?"""
    info = model.model_fields.get(field)
    return info is not None and any(getattr(m, "func", None) is _refuse for m in info.metadata)


def _body_params(resource) -> list[str]:
    return [p for p in inspect.signature(resource.create).parameters if p not in CLIENT_SIDE]


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app(tiny_engine(), MODEL, max_tokens_cap=8, api_key=KEY))


@pytest.mark.parametrize("resource,model", [(r, m) for r, m, _, _ in ENDPOINTS], ids=["completions", "chat"])
def test_every_client_parameter_is_a_field_of_the_request_model(resource, model):
    params = _body_params(resource)
    assert len(params) > 10, params  # the walk found the signature
    missing = [p for p in params if p not in model.model_fields]
    assert not missing, f"sent by openai {openai.__version__} and dropped by the server: {missing}"


@pytest.mark.parametrize("path,base,field", [(path, base, f) for res, model, path, base in ENDPOINTS
                                             for f in _body_params(res) if _refused(model, f)
                                             and f in ASKING])
def test_a_refused_field_is_a_400_naming_it(client, path, base, field):
    r = client.post(path, headers=H, json={**base, field: ASKING[field]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "not supported" in err["message"] and field in err["message"], err


def test_every_refused_chat_field_is_probed():
    refused = [f for f in _body_params(ChatCompletions) if _refused(ChatRequest, f)
               and f not in ("best_of", "suffix", "echo")]  # those three: test_server_openai_errors.py
    assert sorted(refused) == sorted(ASKING), "a refused field without a probe value in ASKING"


def test_legacy_functions_refusal_points_at_tools(client):
    r = client.post("/v1/chat/completions", headers=H, json={**CHAT, "functions": ASKING["functions"]})
    assert r.status_code == 400 and "tools" in r.json()["error"]["message"], r.text


def test_values_that_ask_for_nothing_and_identifiers_are_accepted(client):
    neutral = {"modalities": ["text"], "service_tier": "auto", "reasoning_effort": "none", "store": False,
               "functions": None, "user": "u1", "metadata": {"k": "v"}, "safety_identifier": "s",
               "prompt_cache_key": "p"}
    r = client.post("/v1/chat/completions", headers=H, json={**CHAT, **neutral})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    r = client.post("/v1/completions", headers=H, json={**BASE, "user": "u1"})
    assert r.status_code == 200, r.text
