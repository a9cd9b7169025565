"""Outputs under JSON schemas written elsewhere (the JSON Schema Test Suite, draft 2020-12) validate with
`jsonschema`, generated at temperature 0 and 1, streamed and not; a schema the server cannot serve that way is
refused at admission with a 400 naming response_format."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from _server_utils import KEY, MODEL, H, tiny_engine
from fastapi.testclient import TestClient

xgr = pytest.importorskip("xgrammar")
from jsonschema import Draft202012Validator  # noqa: E402

from lab_utils.structured.schema import prepare_schema  # noqa: E402
from lab_utils.server.app import create_app  # noqa: E402

SUITE = Path(__file__).parents[1] / "data" / "json_schema_test_suite"
FILES = ["required", "properties", "additionalProperties", "minProperties", "maxProperties", "enum", "items",
         "prefixItems", "anyOf", "allOf", "oneOf", "minLength", "maxLength", "minimum", "minItems", "maxItems",
         "pattern", "ref"]


def _corpus() -> tuple[list, list]:
    """(schemas served, schemas refused): per file, its first two groups of each kind."""
    served, refused = [], []
    for name in FILES:
        s = r = 0
        for group in json.loads((SUITE / f"{name}.json").read_text()):
            schema = group["schema"]
            if not isinstance(schema, dict):
                continue
            try:  # what the engine does at admission: narrow, then compile
                xgr.Grammar.from_json_schema(json.dumps(prepare_schema(schema)), any_whitespace=False,
                                             separators=(",", ":"))
                ok = True
            except (ValueError, RuntimeError):
                ok = False
            if ok and s < 2:
                served.append(pytest.param(schema, id=f"{name}-{s}"))
                s += 1
            elif not ok and r < 2:
                refused.append(pytest.param(schema, id=f"{name}-refused-{r}"))
                r += 1
    return served, refused


SERVED, REFUSED = _corpus()
RESULTS: list[str] = []


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app(tiny_engine(), MODEL, max_tokens_cap=96, api_key=KEY))


def _body(schema: dict, temperature: float, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Reply in JSON."}], "max_tokens": 96,
            "temperature": temperature, "seed": 7, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def _generate(client, schema, temperature, stream) -> tuple[int, str, str | None]:
    """(status, text, finish_reason)."""
    r = client.post("/v1/chat/completions", headers=H, json=_body(schema, temperature, stream))
    if r.status_code != 200 or not stream:
        body = r.json()
        if r.status_code != 200:
            return r.status_code, json.dumps(body), None
        return 200, body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert not any("error" in e for e in events), events[-1]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    return 200, text, events[-1]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("schema", SERVED)
def test_outputs_validate(client, schema, temperature, stream):
    status, text, finish = _generate(client, schema, temperature, stream)
    assert status == 200, text
    RESULTS.append(finish)
    if finish == "stop":  # complete: it must validate (a "length" output was cut by max_tokens)
        Draft202012Validator(schema).validate(json.loads(text))


def test_most_outputs_are_complete():
    """The check above is not empty: most generated outputs finished inside max_tokens."""
    print(f"{RESULTS.count('stop')} of {len(RESULTS)} outputs complete")
    assert len(RESULTS) == 4 * len(SERVED) and RESULTS.count("stop") >= len(RESULTS) // 2, RESULTS


@pytest.mark.parametrize("schema", REFUSED)
def test_refused_at_admission(client, schema):
    r = client.post("/v1/chat/completions", headers=H, json=_body(schema, 1.0, False))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format"
