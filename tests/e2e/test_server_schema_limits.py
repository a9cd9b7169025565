"""Through the server: `$ref`s with RFC 6901 escapes (`~0`, `~1`) and percent-encoding (`%20`, `%25`) are served and
the output validates; a legal schema beyond a limit of the server (a self-referencing oneOf, a 2,000-link `$ref`
chain, `items` nested 500 deep) is a 400 `schema_too_complex` naming the limit, and the server keeps serving."""
from __future__ import annotations

import json

import pytest
from _server_utils import KEY, MODEL, H, tiny_engine
from fastapi.testclient import TestClient

pytest.importorskip("xgrammar")
from jsonschema import Draft202012Validator  # noqa: E402

from lab_utils.server.app import create_app  # noqa: E402
from lab_utils.structured.schema import MAX_DEPTH, MAX_REF_LINKS  # noqa: E402
from tests.unit.deep_schemas import nested_items, ref_chain  # noqa: E402


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app(tiny_engine(), MODEL, max_tokens_cap=48, api_key=KEY))


def _ask(client, schema: dict, **extra):
    body = {"model": MODEL, "prompt": "JSON:", "max_tokens": 48, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}, **extra}
    return client.post("/v1/completions", headers=H, json=body)


ESCAPED = {"$defs": {"a/b": {"type": "integer", "minimum": 0, "maximum": 9}, "c~d": {"enum": ["x", "y"]},
                     "e f": {"type": "boolean"}, "100%": {"const": 7}},
           "type": "object", "required": ["slash", "tilde", "space", "percent"],
           "properties": {"slash": {"$ref": "#/$defs/a~1b"}, "tilde": {"$ref": "#/$defs/c~0d"},
                          "space": {"$ref": "#/$defs/e%20f"}, "percent": {"$ref": "#/$defs/100%25"}}}


def test_escaped_refs_are_served_and_the_output_validates(client):
    r = _ask(client, ESCAPED)
    assert r.status_code == 200, r.text
    value = json.loads(r.json()["choices"][0]["text"])
    assert not list(Draft202012Validator(ESCAPED).iter_errors(value)), value
    assert set(value) == {"slash", "tilde", "space", "percent"} and value["percent"] == 7


@pytest.mark.parametrize("schema,says", [
    ({"oneOf": [{"$ref": "#"}, {"type": "null"}]}, "a $ref cycle through oneOf"),
    (ref_chain(2000), f"more than {MAX_REF_LINKS} $refs"),
    (nested_items(500), f"at most {MAX_DEPTH} levels"),
], ids=["oneOf-self-ref", "ref-chain-2000", "items-500-deep"])
def test_a_schema_beyond_a_server_limit_is_a_400_naming_it(client, schema, says):
    r = _ask(client, schema)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "schema_too_complex" and err["param"] == "response_format", err
    assert "beyond a limit of this server" in err["message"] and says in err["message"], err
    assert "malformed" not in err["message"] and "RecursionError" not in err["message"]
    assert client.get("/health").status_code == 200
    assert _ask(client, {"type": "integer"}).status_code == 200  # and it goes on serving
