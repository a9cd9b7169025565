"""API fuzzing from the app's own OpenAPI schema (schemathesis, every check): valid and invalid bodies for every
endpoint, in process (ASGI). No input gets a 5xx, every answer (status, content type, body, headers) is one the
schema documents, a schema-valid body is accepted and a schema-invalid one refused; afterwards the server is
healthy and holds no KV block."""
from __future__ import annotations

import os

import pytest

schemathesis = pytest.importorskip("schemathesis")
from _server_utils import KEY, MODEL, H, tiny_engine, wait_idle
from hypothesis import HealthCheck, settings
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.specs.openapi.checks import positive_data_acceptance

from lab_utils.server.app import create_app

# per endpoint and generation mode; ~10 s in all for the tiny model on 2 cores (FUZZ_MAX_EXAMPLES=200: a deeper run)
MAX_EXAMPLES = int(os.environ.get("FUZZ_MAX_EXAMPLES", "40"))


@pytest.fixture(scope="module")
def fuzz_app():
    engine = tiny_engine(max_num_seqs=8)
    app = create_app(engine, MODEL, max_tokens_cap=4, api_key=KEY, max_body_bytes=32_000)
    yield app
    app.state.async_engine.shutdown()


@pytest.fixture(scope="module")
def api_schema(fuzz_app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    schema.config.generation.update(modes=list(schemathesis.GenerationMode), max_examples=MAX_EXAMPLES)
    # a body over --max-body-bytes is a documented 413 whatever its fields (no JSON schema states a byte size)
    schema.config.checks.positive_data_acceptance.expected_statuses = ["2XX", "401", "404", "413", "503"]
    schema.config.checks.negative_data_rejection.expected_statuses = ["400", "401", "404", "413", "503"]
    return schema


# A schema-valid body the server may still refuse with a 400, for reasons a JSON schema cannot state: how many
# tokens a text is (the context length), rules across fields and messages (OpenAI's), the grammar compiler's verdict
# on a response_format / tool schema, and what the chat template accepts. Each is matched on the error's message.
CROSS_FIELD_REFUSALS = (
    "max_model_len", "KV blocks", "prompt is empty",  # a text's length in tokens
    "needs logprobs: true", "only allowed with stream: true", "min_tokens",  # field against field
    "tool_choice", "tools", "stop strings would cut",  # tools and structured output against the other fields
    "an assistant message needs", "messages[", "chat template",  # conversation rules and the template
    "response_format", "json_schema", "schema",  # a schema the grammar compiler refuses or finds unsatisfiable
)


def accepted_unless_cross_field(ctx, response, case):
    """schemathesis' positive_data_acceptance, less the refusals in CROSS_FIELD_REFUSALS."""
    if response.status_code == 400:
        message = (response.json().get("error") or {}).get("message", "")
        if any(reason in message for reason in CROSS_FIELD_REFUSALS):
            return None
    return positive_data_acceptance(ctx, response, case)


def all_checks() -> list:
    load_all_checks()
    # positive_data_acceptance: replaced by accepted_unless_cross_field (above)
    return [c for c in CHECKS.get_all() if c is not positive_data_acceptance] + [accepted_unless_cross_field]


def _operations(schema) -> list:
    return [r.ok() for r in schema.get_all_operations()]


# one test per endpoint and generation mode; the operations are listed from the schema inside the test (a
# module-level `schema.parametrize()` would build the engine at collection time)
# (a GET without parameters has no invalid input to generate: positive only)
CASES = [("POST", "/v1/completions", "positive"), ("POST", "/v1/completions", "negative"),
         ("POST", "/v1/chat/completions", "positive"), ("POST", "/v1/chat/completions", "negative"),
         ("GET", "/v1/models", "positive"), ("GET", "/health", "positive"), ("GET", "/metrics", "positive")]


@pytest.mark.parametrize("method,path,mode", CASES, ids=[f"{m} {p} {g}" for m, p, g in CASES])
def test_every_answer_matches_the_schema(api_schema, method, path, mode):
    from hypothesis import given

    CHECKS_RUN = all_checks()
    ops = {(op.method.upper(), op.path): op for op in _operations(api_schema)}
    assert (method, path) in ops, f"the schema lists {sorted(ops)}"
    strategy = ops[(method, path)].as_strategy(generation_mode=schemathesis.GenerationMode(mode))

    @given(case=strategy)
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case):
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = MODEL  # a random name only ever meets the 404: aim past it, at the engine
        response = case.call(headers=H)
        case.validate_response(response, checks=CHECKS_RUN, headers=H)

    check()


def test_healthy_and_no_blocks_held_after_fuzzing(fuzz_app, api_schema):
    from starlette.testclient import TestClient

    engine = fuzz_app.state.engine
    wait_idle(engine)
    print(f"fuzzing: {engine.num_finished} requests ran to the end, {engine.num_aborted} aborted")
    assert engine.num_finished >= 10, "the fuzzer's valid requests should reach the engine and finish"
    engine.block_manager.check_all_free()
    client = TestClient(fuzz_app)
    assert client.get("/health").status_code == 200
    r = client.post("/v1/completions", headers=H, json={"model": MODEL, "prompt": [5, 6], "max_tokens": 3,
                                                        "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert fuzz_app.state.async_engine.num_step_failures == 0, "a fuzzed input reached the engine and broke a step"
