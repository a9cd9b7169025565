"""Several models from one server process, by name (OpenAI's `model` field): `/v1/models` lists them, a request's
`model` picks the engine and the answer names the model that served it, an unknown name is OpenAI's 404
`model_not_found`, and an engine that fails leaves the other serving. Through the official `openai` client;
the second model is the course's committed draft (data/models/smollm2-draft), nothing is downloaded."""
from __future__ import annotations

import argparse

import httpx
import pytest
from _server_utils import KEY, MODEL, H, UvicornThread, tiny_engine, wait_idle

from lab_utils.server.app import create_app

openai = pytest.importorskip("openai")
DRAFT = "smollm2-draft"


def draft_engine():
    from lab_utils import EngineConfig, LLMEngine

    return LLMEngine(DRAFT, EngineConfig(max_num_seqs=16, max_num_batched_tokens=256,
                                         kv_cache_memory_bytes=64 << 20), device="cpu")


def two_model_server():
    engines = {MODEL: tiny_engine(), DRAFT: draft_engine()}
    app = create_app(engines[MODEL], MODEL, max_tokens_cap=16, api_key=KEY, extra_models={DRAFT: engines[DRAFT]})
    srv = UvicornThread(app)
    srv.engines = engines
    return srv


@pytest.fixture(scope="module")
def server():
    with two_model_server() as srv:
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY)
        yield srv
    srv.app.state.models.by_name[DRAFT].aengine.shutdown()


def _ask(client, model: str, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a colour."}],
                                          max_tokens=4, temperature=0, extra_body={"ignore_eos": True}, **kw)


def test_models_lists_every_served_model(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL, DRAFT]
    assert all(m.owned_by == "lab_utils" for m in models.data)


@pytest.mark.parametrize("model", [MODEL, DRAFT])
def test_the_request_model_picks_the_engine_and_the_answer_names_it(server, model):
    finished = {name: e.num_finished for name, e in server.engines.items()}
    reply = _ask(server.client, model)
    assert reply.model == model and reply.usage.completion_tokens == 4
    wait_idle(server.engines[model])
    ran = {name: e.num_finished - finished[name] for name, e in server.engines.items()}
    assert ran == {name: int(name == model) for name in server.engines}, ran
    chunks = list(_ask(server.client, model, stream=True))
    assert {c.model for c in chunks} == {model}
    text = server.client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0)
    assert text.model == model


def test_two_models_answer_differently(server):
    """Different weights, so greedy answers differ: the name really routes (not one engine under two names)."""
    ids = {name: server.client.completions.create(model=name, prompt="The capital of France is", max_tokens=8,
                                                  temperature=0, extra_body={"return_token_ids": True,
                                                                             "ignore_eos": True})
           for name in (MODEL, DRAFT)}
    tokens = {name: r.choices[0].model_extra["token_ids"] for name, r in ids.items()}
    assert tokens[MODEL] != tokens[DRAFT]


def test_an_unknown_model_is_openais_404_model_not_found(server):
    with pytest.raises(openai.NotFoundError) as info:
        _ask(server.client, "gpt-9")
    error = info.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model", error
    assert error["type"] == "invalid_request_error" and "gpt-9" in error["message"] and DRAFT in error["message"]


def test_metrics_label_each_models_samples(server):
    text = httpx.get(server.url + "/metrics").text
    for name in (MODEL, DRAFT):
        assert f'lab:num_requests_running{{model_name="{name}"}}' in text, text[:2000]
    assert text.count("# TYPE lab:num_requests_running gauge") == 1  # one family, a sample per model


def test_an_engine_that_dies_leaves_the_other_model_serving():
    with two_model_server() as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
        draft = srv.app.state.models.by_name[DRAFT].aengine
        with draft._lock:
            draft._die(RuntimeError("the draft's card fell off"))
        with pytest.raises(openai.InternalServerError) as info:  # 503: this engine serves nobody until a restart
            _ask(client, DRAFT)
        assert info.value.status_code == 503
        assert _ask(client, MODEL).usage.completion_tokens == 4  # the other engine still serves
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 500 and DRAFT in health.json()["error"]["message"]
        assert MODEL not in health.json()["error"]["message"]
        wait_idle(srv.engines[MODEL])
        srv.engines[MODEL].block_manager.check_all_free()
        r = httpx.post(srv.url + "/v1/completions", headers=H, json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == MODEL
    draft.shutdown()


def test_serve_builds_an_engine_per_extra_model():
    from lab_utils.server import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", MODEL, "--extra-model", DRAFT, "--extra-model", f"small={DRAFT}",
                              "--device", "cpu", "--kv-cache-memory-bytes", str(16 << 20),
                              "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert cli.extra_models(args) == {DRAFT: DRAFT, "small": DRAFT}
    engine, extras = cli.build_engines(args)
    assert list(extras) == [DRAFT, "small"] and extras["small"] is not extras[DRAFT]
    assert engine.spec is not None and all(e.spec is None for e in extras.values())  # the draft is the main's
    assert {e.model.config.num_hidden_layers for e in extras.values()} == {3}


def test_a_server_process_serves_both_models():
    """`python -m lab_utils serve --model tiny-random --extra-model smollm2-draft`, as lab 15 starts it."""
    from lab_utils.server.process import LabServer

    with LabServer(MODEL, device="cpu", api_key=KEY, extra_models=[DRAFT], max_num_seqs=4,
                   kv_cache_memory_bytes=16 << 20) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY)
        assert [m.id for m in client.models.list().data] == [MODEL, DRAFT]
        assert _ask(client, DRAFT).model == DRAFT
