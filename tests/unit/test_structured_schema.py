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
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, Unsupported, "oneOf branches 0 and 1 may both"),
    ({"oneOf": [{"type": "object", "required": ["a"]}, {"type": "object", "properties": {"a": {}, "b": {}}}]},
     Unsupported, "oneOf branches 0 and 1"),  # {"a": 1} meets both
    ({"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]}, Unsupported, "'pattern' differently"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, Unsatisfiable, "of type"),
    ({"allOf": [{"properties": {"a": {}}, "additionalProperties": False}, {"required": ["b"]}]}, Unsatisfiable,
     "'b' is required"),
    ({"allOf": [{"$ref": "#"}]}, Unsupported, "deep"),
    ({"$defs": {"x": {"type": "integer"}}, "properties": {"p": {"$ref": "#/allOf/0"}}, "allOf": [{"type": "object"}]},
     Unsupported, "inside an allOf"),
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


PET = {"oneOf": [{"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                  "required": ["kind", "lives"]},
                 {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
                  "required": ["kind"]}]}
BASE = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}


@pytest.mark.parametrize("schema,bad,good", [
    ({"allOf": [BASE, {"properties": {"name": {"type": "string"}}, "required": ["name"]}]},
     {"id": 1}, {"id": 1, "name": "x"}),  # xgrammar alone: any JSON value
    ({"$defs": {"base": BASE}, "allOf": [{"$ref": "#/$defs/base"}, {"required": ["tag"]}]}, {"tag": 1},
     {"id": 1, "tag": 1}),
    ({"allOf": [{"type": "integer", "minimum": 3}, {"maximum": 5}]}, 6, 4),
    ({"allOf": [{"properties": {"a": {"type": "integer"}}, "additionalProperties": False},
                {"properties": {"b": {"type": "string"}}}]}, {"a": 1, "b": "x"}, {"a": 1}),  # b: forbidden by the first
    ({"allOf": [{"enum": [1, 2, "x"]}, {"type": "integer"}]}, "x", 2),
    ({"allOf": [{"prefixItems": [{"type": "integer"}]}, {"items": {"minimum": 5}}], "type": "array"}, [3], [5, 6]),
    (PET, {"kind": "cat", "good": True}, {"kind": "cat", "lives": 9}),  # a discriminated union
    (PET, {"kind": "dog", "good": 1}, {"kind": "dog", "good": True}),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}, 1.5, None),
    ({"type": "object", "oneOf": [{"required": ["foo", "bar"]}, {"required": ["foo", "baz"]}]}, {"foo": 1},
     {"foo": 1, "bar": 2}),
    ({"type": "integer", "anyOf": [{"minimum": 0}]}, 1.5, 1),  # beside anyOf: xgrammar alone reads only the anyOf
    ({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x", "maximum": 3}, 5, 2),  # beside $ref: the same
    ({"$defs": {"x": {"type": "object", "properties": {"a": {"type": "integer"}}}}, "type": "object",
      "properties": {"p": {"$ref": "#/$defs/x", "required": ["a"]}}, "required": ["p"]}, {"p": {}}, {"p": {"a": 1}}),
])
def test_combinators_and_keywords_beside_them_are_enforced(schema, bad, good):
    grammar = _grammar(schema)
    assert grammar is not None
    assert not accepts(grammar, _text(bad)) and accepts(grammar, _text(good))
    assert Draft202012Validator(schema).is_valid(good) and not Draft202012Validator(schema).is_valid(bad)


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
                            "allOf", "oneOf", "const", "minimum",
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


def test_json_object_is_the_object_grammar_whose_keys_can_repeat():
    """What docs/SERVER.md says of `json_object`: xgrammar's grammar for {"type": "object"} (as vLLM compiles it),
    one object of any keys and values, keys not tracked at any depth (a key can repeat), `", "` between members."""
    grammar = xgr.Grammar.from_json_schema(json.dumps({"type": "object"}), any_whitespace=False,
                                           separators=(",", ":"))
    for text in ('{}', '{"a":1}', '{"a":1, "a":2}', '{"a":{"b":[1, {"b":null}], "b":true}}'):
        assert accepts(grammar, text) and isinstance(json.loads(text), dict), text
    for text in ('[1]', '1', '{"a": 1}', '"x"'):
        assert not accepts(grammar, text), text


def test_generated_combinations_never_leak():
    """Schemas generated from allOf / oneOf / anyOf over objects, arrays and scalars (hypothesis): every generated
    value the grammar of a served schema accepts (compact or with xgrammar's ", ") validates."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    keys, scalars = st.sampled_from(["a", "b", "c"]), st.sampled_from([1, 2, "a", "b", None, True])
    leaf = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["integer", "string", "boolean", "null", "number"])}),
                     st.fixed_dictionaries({"const": scalars}),
                     st.fixed_dictionaries({"enum": st.lists(scalars, min_size=1, max_size=3)}),
                     st.fixed_dictionaries({"minimum": st.integers(0, 3)}), st.fixed_dictionaries({"maximum": st.integers(0, 3)}),
                     st.fixed_dictionaries({"maxLength": st.integers(0, 2)}), st.just({}), st.booleans())

    def branches(inner, word):
        return st.fixed_dictionaries({word: st.lists(inner, min_size=1, max_size=3)})

    schemas = st.recursive(leaf, lambda inner: st.one_of(
        st.fixed_dictionaries({"properties": st.dictionaries(keys, inner, max_size=2)}, optional={
            "required": st.lists(keys, max_size=2, unique=True), "type": st.just("object"),
            "additionalProperties": st.sampled_from([False, True, {"type": "integer"}])}),
        st.fixed_dictionaries({"type": st.just("array")}, optional={
            "items": inner, "prefixItems": st.lists(inner, max_size=2), "maxItems": st.integers(0, 3)}),
        branches(inner, "allOf"), branches(inner, "oneOf"), branches(inner, "anyOf")), max_leaves=8)
    values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-1, 4), st.sampled_from(["a", "", "ab", 1.5])),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
                          max_leaves=6)
    leaks, accepted = [], []

    @settings(max_examples=300, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(schemas.filter(lambda s: isinstance(s, dict)), st.lists(values, min_size=8, max_size=8))
    def check(schema, instances):
        grammar = _grammar(schema)
        if grammar is None:
            return
        for value in instances:
            texts = {json.dumps(value, separators=seps) for seps in ((",", ":"), (", ", ":"))}
            if any(accepts(grammar, t) for t in texts):
                accepted.append(value)
                if not Draft202012Validator(schema).is_valid(value):
                    leaks.append((schema, value))

    check()
    assert not leaks, leaks[:3]
    assert len(accepted) >= 50, len(accepted)  # the check is not empty
