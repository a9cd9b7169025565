"""Structured output that always validates: `prepare_schema` narrows a schema so the grammar's language is
inside the schema's, or refuses it. Judged on schemas written elsewhere (the JSON Schema Test Suite, draft
2020-12, tests/data/json_schema_test_suite): for every schema served, each of the suite's instances that the
grammar accepts validates against the schema as sent, with `jsonschema`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

xgr = pytest.importorskip("xgrammar")
from jsonschema import Draft202012Validator  # noqa: E402
from xgrammar.testing import _is_grammar_accept_string as accepts  # noqa: E402

from lab_utils.structured.schema import Unsatisfiable, Unsupported, prepare_schema  # noqa: E402

SUITE = Path(__file__).parents[1] / "data" / "json_schema_test_suite"


def _grammar(schema: dict):
    """The grammar the engine compiles for `schema` (compact JSON, as the server asks), None if refused."""
    try:
        prepared = prepare_schema(schema)
        return xgr.Grammar.from_json_schema(json.dumps(prepared), any_whitespace=False, separators=(",", ":"),
                                            strict_mode=True)
    except (ValueError, RuntimeError):
        return None


def _text(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def test_every_instance_the_grammar_accepts_is_valid_on_the_suite():
    served = refused = checked = 0
    leaks = []
    for path in sorted(SUITE.glob("*.json")):
        for group in json.loads(path.read_text()):
            if not isinstance(group["schema"], dict):
                continue
            grammar = _grammar(group["schema"])
            if grammar is None:
                refused += 1
                continue
            served += 1
            validator = Draft202012Validator(group["schema"])
            for case in group["tests"]:
                if accepts(grammar, _text(case["data"])):
                    checked += 1
                    if not validator.is_valid(case["data"]):
                        leaks.append(f"{path.stem}: {group['description']} / {case['description']}")
    assert not leaks, leaks
    assert served >= 60 and refused >= 30 and checked >= 80, (served, refused, checked)  # 71, 72, 91 today


@pytest.mark.parametrize("schema,bad,good", [
    ({"type": "object", "required": ["zz"]}, {}, {"zz": 1}),  # required without properties
    ({"minLength": 2}, "a", "ab"),  # no type: the compiler would let anything through
    ({"type": "object", "minProperties": 1, "properties": {"a": {"type": "integer"}}}, {}, {"a": 1}),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 1}, [1, 2], [1]),
])
def test_narrowed_schemas_refuse_what_the_schema_refuses(schema, bad, good):
    grammar = _grammar(schema)
    assert grammar is not None
    assert not accepts(grammar, _text(bad)) and accepts(grammar, _text(good))


def test_free_keys_are_never_repeated():
    """An object's keys are those `properties` names (additionalProperties narrowed to false): a duplicate key
    cannot be written, and minProperties above the named keys is refused."""
    grammar = _grammar({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                        "minProperties": 2, "additionalProperties": {"type": "integer"}})
    assert accepts(grammar, '{"a":1,"b":2}')
    assert not accepts(grammar, '{"a":1,"a":2}') and not accepts(grammar, '{"c":1,"c":2}')
    with pytest.raises(Unsatisfiable, match="minProperties"):
        prepare_schema({"type": "object", "minProperties": 2, "additionalProperties": {"type": "integer"}})


@pytest.mark.parametrize("schema,kind,match", [
    ({"type": "array", "uniqueItems": True}, Unsupported, "uniqueItems"),
    ({"not": {"type": "string"}}, Unsupported, "not"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, Unsupported, "oneOf"),
    ({"type": "number", "multipleOf": 1.5}, Unsupported, "multipleOf"),
    ({"$ref": "http://example.com/s.json"}, Unsupported, "only references inside"),
    ({"$ref": "#"}, Unsatisfiable, "cycle"),
    ({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}, Unsatisfiable, "cycle"),
    ({"$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}}, "$ref": "#/$defs/a"},
     Unsatisfiable, "cycle"),
    ({"type": "object", "properties": {}, "additionalProperties": False, "required": ["a"]}, Unsatisfiable,
     "requires 'a'"),
    ({"type": "object", "required": ["a", "b"], "maxProperties": 1}, Unsatisfiable, "maxProperties"),
])
def test_schemas_that_cannot_be_served_are_refused_with_the_reason(schema, kind, match):
    with pytest.raises(kind, match=match):
        prepare_schema(schema)


def test_satisfiable_schemas_and_optional_cycles_are_served():
    tree = {"type": "object", "properties": {"value": {"type": "integer"}, "next": {"$ref": "#"}},
            "required": ["value"]}  # a linked list: the cycle is optional, so it ends
    assert _grammar(tree) is not None and accepts(_grammar(tree), '{"value":1,"next":{"value":2}}')
    branch = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["a"]}, {"type": "integer"}]}
    assert prepare_schema(branch)["anyOf"] == [{"type": "integer"}]  # the branch no value fits is dropped
    assert prepare_schema({"type": "object", "required": ["a"]})["properties"] == {"a": {}}


def test_any_json_value_as_a_schema_is_served_or_a_value_error():
    """Clients send anything as a schema: prepare_schema answers a schema or a ValueError, never another error."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    keys = st.sampled_from(["type", "properties", "required", "items", "prefixItems", "anyOf", "$ref", "$defs",
                            "minProperties", "maxProperties", "uniqueItems", "maxItems", "minItems", "enum",
                            "additionalProperties", "multipleOf", "a", "#"])
    leaves = st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=True) | st.sampled_from(
        ["object", "array", "string", "integer", "#", "#/$defs/a", "#/properties/a", "a"])
    values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=4),
                          max_leaves=20)

    @settings(max_examples=300, deadline=None, database=None, derandomize=True)
    @given(st.dictionaries(keys, values, max_size=5))
    def check(schema):
        try:
            prepare_schema(schema)
        except ValueError:
            pass

    check()
