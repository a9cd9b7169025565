"""`$ref`s are read as JSON Schema reads them (RFC 6901 escapes in a percent-encoded fragment) and the grammar
compiled from them enforces their targets; a legal schema beyond what the server checks is refused as a
`ServerLimit` naming the limit, never as "malformed"."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab_utils.structured.pointer import plain_refs, pointer_keys, resolve
from lab_utils.structured.schema import MAX_DEPTH, MAX_REF_LINKS, ServerLimit, prepare_schema
from tests.unit.deep_schemas import nested_items, ref_chain

SUITE = Path(__file__).parents[1] / "data" / "json_schema_test_suite"


@pytest.mark.parametrize("ref,keys", [
    ("#", []), ("#/$defs/a", ["$defs", "a"]), ("#/$defs/a~1b", ["$defs", "a/b"]), ("#/$defs/a~0b", ["$defs", "a~b"]),
    ("#/$defs/~01", ["$defs", "~1"]),  # "~0" first would give "~1" -> "/": the order RFC 6901 fixes
    ("#/$defs/a%20b", ["$defs", "a b"]), ("#/$defs/100%25", ["$defs", "100%"]), ("#/a%2Fb", ["a", "b"]),
    ("#/items/0", ["items", "0"])])
def test_pointer_keys_decode_the_fragment_then_the_pointer(ref, keys):
    assert pointer_keys(ref) == keys


@pytest.mark.parametrize("ref,says", [("#/$defs/a~2b", "'~' must be followed by 0 or 1"),
                                      ("#anchor", "not anchors"), ("other.json#/a", "only references inside")])
def test_a_malformed_pointer_is_named(ref, says):
    with pytest.raises(ValueError, match=says):
        pointer_keys(ref)
    with pytest.raises(ValueError, match=says if ref.startswith("#") else "not supported"):
        prepare_schema({"$defs": {"a~2b": {"type": "integer"}}, "$ref": ref})


def test_resolve_walks_lists_and_says_when_a_ref_points_to_nothing():
    root = {"prefixItems": [{"type": "string"}, {"type": "integer"}], "$defs": {"a b": {"const": 1}}}
    assert resolve(root, "#/prefixItems/1") == {"type": "integer"}
    assert resolve(root, "#/$defs/a%20b") == {"const": 1}
    for ref in ("#/prefixItems/2", "#/$defs/a b c", "#/$defs/a%20b/x"):
        with pytest.raises(ValueError, match="points to nothing"):
            resolve(root, ref)


def test_plain_refs_point_escaped_refs_at_the_same_target():
    target = {"type": "integer", "minimum": 3}
    root = {"$defs": {"a/b": target, "plain": {"type": "string"}},
            "properties": {"x": {"$ref": "#/$defs/a~1b"}, "y": {"$ref": "#/$defs/a~1b"}, "z": {"$ref": "#/$defs/plain"}}}
    out = plain_refs(root)
    x, y, z = (out["properties"][k]["$ref"] for k in "xyz")
    assert x == y and x.startswith("#/$defs/") and "~" not in x and z == "#/$defs/plain"  # plain refs untouched
    assert resolve(out, x) is target


def _grammar(schema: dict):
    xgr = pytest.importorskip("xgrammar")
    return xgr.Grammar.from_json_schema(json.dumps(prepare_schema(schema)), any_whitespace=False,
                                        separators=(",", ":"))


def _accepts(grammar, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(grammar, text)


def test_the_suites_escaped_pointer_schema_compiles_and_enforces_each_target():
    group = next(g for g in json.loads((SUITE / "ref.json").read_text()) if g["description"] == "escaped pointer ref")
    grammar = _grammar(group["schema"])
    assert _accepts(grammar, '{"tilde":1,"slash":2,"percent":3}')
    for key in ("tilde", "slash", "percent"):  # each key's target is the integer its escaped $ref names
        fields = {"tilde": 1, "slash": 2, "percent": 3, key: "aoeu"}
        assert not _accepts(grammar, json.dumps(fields, separators=(",", ":")))


def test_a_space_in_a_defs_key_is_reached_percent_encoded():
    grammar = _grammar({"$defs": {"a b": {"type": "integer"}}, "type": "object",
                        "properties": {"n": {"$ref": "#/$defs/a%20b"}}, "required": ["n"]})
    assert _accepts(grammar, '{"n":12}') and not _accepts(grammar, '{"n":"x"}')


@pytest.mark.parametrize("schema,says", [
    (nested_items(500), f"at most {MAX_DEPTH} levels (MAX_DEPTH)"),
    (ref_chain(2000), f"more than {MAX_REF_LINKS} $refs one inside another (MAX_REF_LINKS)"),
    ({"oneOf": [{"$ref": "#"}, {"type": "null"}]}, "a $ref cycle through oneOf"),
], ids=["items-500-deep", "ref-chain-2000", "oneOf-self-ref"])
def test_a_schema_beyond_a_limit_is_refused_naming_the_limit(schema, says):
    with pytest.raises(ServerLimit) as err:
        prepare_schema(schema)
    assert says in str(err.value) and "malformed" not in str(err.value)


def test_just_inside_the_limits_is_served():
    prepare_schema(nested_items(MAX_DEPTH - 1))  # the root is the first level
    prepare_schema(ref_chain(MAX_REF_LINKS - 1))


def test_a_schema_too_deep_for_the_recursion_is_still_a_limit_not_malformed():
    """Inside MAX_DEPTH, but with Python's recursion limit lowered so that checking it runs out: the refusal
    names the server's limit (a real stack runs out the same way on schemas whose levels cost many frames)."""
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(__import__("inspect").stack(0)) + 120)
    try:
        with pytest.raises(ServerLimit, match="recursed deeper than this server's limit"):
            prepare_schema(nested_items(100))
    finally:
        sys.setrecursionlimit(limit)
    prepare_schema(nested_items(100))  # with the usual limit: served
