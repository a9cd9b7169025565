"""A JSON schema made safe to generate from: every output the grammar allows validates against the schema as
the client sent it (JSON Schema draft 2020-12), or the schema is refused with a ValueError saying why.

The grammar compiler (xgrammar) enforces most of JSON Schema but not all of it: some keywords it ignores (a
schema without `type` accepts anything, `uniqueItems`, `not`, `if`, `oneOf`'s "exactly one", ...), and an
object whose keys are free (`additionalProperties`) can repeat a key. So before compiling, `prepare_schema`
rewrites the schema into one whose language is a *subset* of the original's (any output of it is valid for the
original), or refuses it:

- a subschema without `type` whose keywords belong to one kind of value (`minLength`, `minimum`, `items`,
  `required`, ...) gets that `type` (without it, the compiler lets any value through);
- an object's `required` keys missing from `properties` are added to them (any value), and objects get only
  the keys their `properties` name (`additionalProperties` is narrowed to false): keys are then written once
  each, in order, so no key is ever repeated;
- `allOf` is merged into one schema, `oneOf` becomes an `anyOf` of disjoint branches, the keywords beside an
  `anyOf` go into each branch and those beside a `$ref` are merged with its target (combine.py: the compiler
  itself does not intersect schemas, enforce "exactly one" or read what stands beside `anyOf` or `$ref`), or
  they are refused saying why;
- keywords the grammar cannot enforce are refused by name (`uniqueItems` unless `maxItems` <= 1, `not`,
  `if`/`then`/`else`, `contains`, `dependentRequired`, `patternProperties`, `propertyNames`,
  `unevaluated*`, `$dynamicRef`, a `multipleOf` that is not an integer's, a `$ref` outside this document);
- a schema no finite value can meet is refused: `minProperties` above the keys it names, `maxProperties` below
  its required keys, or a `$ref` cycle through required properties or non-empty arrays
  (`{"properties": {"next": {"$ref": "#"}}, "required": ["next"]}` has no finite output); an optional property
  or an `anyOf` branch that admits nothing (`false`, or such a cycle) is dropped instead;
- a `$ref` is a JSON Pointer with RFC 6901's escapes in a percent-encoded URI fragment (pointer.py), pointed
  at a plainly named copy under `$defs` when the compiler would misread it;
- a legal schema beyond what this server checks is refused as such (`ServerLimit`, naming the limit): nested
  more than `MAX_DEPTH` subschemas deep, a chain of more than `MAX_REF_LINKS` `$ref`s, `oneOf`s that inline
  `$ref`s into each other more than `MAX_INLINE_DEPTH` deep (a cycle through `oneOf`).
"""
from __future__ import annotations

import copy

from lab_utils.structured.combine import (ANNOTATIONS, MAX_INLINE_DEPTH, distribute_any_of, flatten_all_of,
                                          one_of_as_any_of)
from lab_utils.structured.pointer import plain_refs, pointer_keys, resolve

UNSUPPORTED = {
    "not": "the grammar cannot exclude a schema",
    "if": "conditional schemas are not enforced", "then": "conditional schemas are not enforced",
    "else": "conditional schemas are not enforced",
    "contains": "not enforced", "minContains": "not enforced", "maxContains": "not enforced",
    "dependentRequired": "not enforced", "dependentSchemas": "not enforced", "dependencies": "not enforced",
    "patternProperties": "only the keys named in properties are generated",
    "propertyNames": "only the keys named in properties are generated",
    "unevaluatedProperties": "not enforced", "unevaluatedItems": "not enforced",
    "$dynamicRef": "not resolved", "$dynamicAnchor": "not resolved", "$anchor": "not resolved",
    "$recursiveRef": "not resolved",
}
FAMILIES = (  # keyword -> the type whose values it constrains (the first family present decides)
    ("object", ("properties", "required", "additionalProperties", "minProperties", "maxProperties")),
    ("array", ("items", "prefixItems", "minItems", "maxItems", "uniqueItems")),
    ("string", ("minLength", "maxLength", "pattern", "format")),
    ("number", ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")),
)
KEPT_BESIDE_ANY_OF = {"$defs", "definitions", *ANNOTATIONS}  # the rest is merged into its branches
MAX_NODES = 20_000  # a schema bigger than this is refused (walking it is the server's time)
MAX_DEPTH = 256  # subschemas nested inside each other (the checks below recurse once per level)
MAX_REF_LINKS = 100  # $refs followed one after another (a $ref to a $ref to ...)


class Unsupported(ValueError):
    """The schema uses what the grammar cannot enforce."""


class Unsatisfiable(ValueError):
    """No finite JSON value meets the schema (as far as the schema itself shows)."""


class ServerLimit(ValueError):
    """A legal schema beyond what this server checks (the message names the limit): the server's, not the
    client's, fault."""


def prepare_schema(schema: dict) -> dict:
    """The schema to compile (a narrowed copy of `schema`); ValueError naming the place and the reason if it
    cannot be generated from so that every output validates."""
    if not isinstance(schema, dict):
        raise Unsupported(f"a JSON schema must be an object, got {type(schema).__name__}")
    depth = _depth(schema)
    if depth > MAX_DEPTH:
        raise ServerLimit(f"it nests subschemas {depth} deep; this server checks at most {MAX_DEPTH} levels "
                          f"(MAX_DEPTH): nest less deeply, or name repeated parts in $defs")
    try:
        out = copy.deepcopy(schema)
        _refuse_refs_into_combinators(out)
        _Walker(out).walk(out, "#")
        producible = _producible(out, out, "#", (), [0])
    except RecursionError:
        raise ServerLimit(f"checking it recursed deeper than this server's limit (its nesting and $ref links "
                          f"together; at most {MAX_DEPTH} levels and {MAX_REF_LINKS} links each)") from None
    except (TypeError, AttributeError, KeyError, IndexError) as err:  # e.g. "type": [{}]
        raise Unsupported(f"the schema is malformed ({type(err).__name__}: {err})") from None
    if not producible:
        raise Unsatisfiable("no finite value meets it: a $ref cycle runs through required properties or "
                            "non-empty arrays (or a required part admits nothing)")
    return plain_refs(out)


def _depth(schema) -> int:
    """How many objects deep the schema nests (without recursion: a deep schema must not crash the check)."""
    deepest, stack = 0, [(schema, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in x.values())
        elif isinstance(x, list):
            stack.extend((v, d) for v in x)
    return deepest


def _refuse_refs_into_combinators(node) -> None:
    """A `$ref` into an allOf / oneOf member would point nowhere once they are merged: refused."""
    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            ref = x.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and {"allOf", "oneOf"} & set(_keys(ref)):
                raise Unsupported(f"$ref {ref!r} points inside an allOf / oneOf member; move that schema to $defs")
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)


def _keys(ref: str) -> list[str]:
    try:
        return pointer_keys(ref)
    except ValueError as err:
        raise Unsupported(str(err)) from None


class _Walker:
    def __init__(self, root: dict) -> None:
        self.nodes = 0
        self.root = root
        self.one_of_depth = 0  # oneOfs being rewritten inside each other (through inlined $refs)

    def narrowed(self, node: dict, where: str) -> dict:
        self.walk(node, where)
        return node

    def walk(self, node, where: str) -> None:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise Unsupported(f"the schema has more than {MAX_NODES} subschemas")
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if isinstance(ref, str) and set(node) - KEPT_BESIDE_ANY_OF - {"$ref"}:  # the compiler reads only the $ref
            node["allOf"] = [{"$ref": node.pop("$ref")},
                             {k: node.pop(k) for k in list(node) if k not in KEPT_BESIDE_ANY_OF and k != "allOf"},
                             *node.pop("allOf", [])]
        if "allOf" in node:  # merged into one schema (the compiler does not intersect schemas)
            merged = flatten_all_of(node, self.root, where, Unsupported, Unsatisfiable)
            node.clear()
            node.update(merged)
        if "oneOf" in node:  # an anyOf of disjoint branches (the compiler cannot enforce "exactly one")
            self.one_of_depth += 1
            if self.one_of_depth > MAX_INLINE_DEPTH:
                raise ServerLimit(f"{where}: oneOf branches inline $refs into other oneOfs more than "
                                  f"{MAX_INLINE_DEPTH} deep (MAX_INLINE_DEPTH; a $ref cycle through oneOf): move "
                                  f"the recursive part out of oneOf, e.g. into an anyOf")
            try:
                replaced = one_of_as_any_of(node, self.root, where, self.narrowed, Unsupported, Unsatisfiable)
            finally:
                self.one_of_depth -= 1
            node.clear()
            node.update(replaced)
        if isinstance(node.get("anyOf"), list) and set(node) - KEPT_BESIDE_ANY_OF - {"anyOf"}:
            distributed = distribute_any_of(node, self.root, where, Unsupported, Unsatisfiable)
            node.clear()
            node.update(distributed)
        for key, why in UNSUPPORTED.items():
            if key in node:
                raise Unsupported(f"{where}: {key!r} is not supported ({why})")
        ref = node.get("$ref")
        if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
            raise Unsupported(f"{where}: $ref {ref!r} is not supported: only references inside this schema "
                             f"('#' or '#/$defs/...')")
        if ref is not None:
            _keys(ref)  # a malformed pointer is named here
        if "$id" in node and where != "#":
            raise Unsupported(f"{where}: '$id' inside a schema is not supported (references resolve against the root)")
        if "type" not in node and not ({"enum", "const", "$ref", "anyOf"} & node.keys()):
            family = next((t for t, keys in FAMILIES if any(k in node for k in keys)), None)
            if family is not None:
                node["type"] = family  # narrowed: without a type the compiler lets any value through
        types = node.get("type")
        types = set(types) if isinstance(types, list) else {types}
        if "multipleOf" in node and not (types <= {"integer"} and isinstance(node["multipleOf"], int)):
            raise Unsupported(f"{where}: 'multipleOf' is enforced only for integers by an integer")
        if node.get("uniqueItems") is True:
            if not (isinstance(node.get("maxItems"), int) and node["maxItems"] <= 1):
                raise Unsupported(f"{where}: 'uniqueItems' is not supported (the grammar cannot keep items "
                                 f"distinct); drop it, or set maxItems to 1")
        node.pop("uniqueItems", None)
        if "object" in types or "properties" in node or "required" in node:
            self._object(node, where)
        required = set(node.get("required") or [])
        for name, sub in list((node.get("properties") or {}).items()):
            try:
                if sub is False:
                    raise Unsatisfiable(f"{where}/properties/{name}: the schema false admits no value")
                self.walk(sub, f"{where}/properties/{name}")
            except Unsatisfiable:
                if name in required:
                    raise
                del node["properties"][name]  # an optional key no value fits: never written (narrowed)
        for key in ("$defs", "definitions"):
            if isinstance(node.get(key), dict):
                for name, sub in node[key].items():
                    self.walk(sub, f"{where}/{key}/{name}")
        for key in ("items", "additionalItems"):
            if isinstance(node.get(key), dict):
                self.walk(node[key], f"{where}/{key}")
        for i, sub in enumerate(node.get("prefixItems") or []):
            self.walk(sub, f"{where}/prefixItems/{i}")
        if isinstance(node.get("anyOf"), list):
            kept, why = [], None
            for i, sub in enumerate(node["anyOf"]):
                try:
                    if sub is False:
                        raise Unsatisfiable(f"{where}/anyOf/{i}: the schema false admits no value")
                    self.walk(sub, f"{where}/anyOf/{i}")
                    kept.append(sub)
                except Unsatisfiable as err:  # a branch no value fits: dropped (narrowed)
                    why = err
            if why is not None and not kept:
                raise why
            node["anyOf"] = kept

    @staticmethod
    def _object(node: dict, where: str) -> None:
        props = node.setdefault("properties", {})
        required = node.get("required") or []
        extra = node.get("additionalProperties", True)
        for k in required:
            if isinstance(k, str) and k not in props:
                if extra is False:
                    raise Unsatisfiable(f"{where}: it requires {k!r} but allows only the keys {sorted(props)} "
                                     f"(additionalProperties is false)")
                props[k] = copy.deepcopy(extra) if isinstance(extra, dict) else {}
        node["additionalProperties"] = False  # narrowed: only named keys, each written once
        lo, hi = node.get("minProperties"), node.get("maxProperties")
        if isinstance(lo, int) and lo > len(props):
            raise Unsatisfiable(f"{where}: minProperties {lo} asks for more keys than properties names ({len(props)}); "
                             f"this server writes only the keys properties names")
        if isinstance(hi, int) and hi < len(set(required)):
            raise Unsatisfiable(f"{where}: maxProperties {hi} is below the {len(set(required))} required keys")


def _producible(node, root: dict, where: str, refs: tuple, budget: list) -> bool:
    """Whether some finite value meets `node` as far as its required parts go (a $ref already being expanded on
    this path counts as not producible: going round the cycle never ends)."""
    budget[0] += 1
    if budget[0] > MAX_NODES:
        return True  # too large to decide here: the grammar's own start check remains
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str):
        if ref in refs:
            return False
        if len(refs) >= MAX_REF_LINKS:
            raise ServerLimit(f"{where}: it follows more than {MAX_REF_LINKS} $refs one inside another "
                              f"(MAX_REF_LINKS); shorten the chain of $refs")
        if not _producible(resolve(root, ref), root, ref, (*refs, ref), budget):
            return False
    if isinstance(node.get("anyOf"), list) and node["anyOf"]:
        if not any(_producible(s, root, where, refs, budget) for s in node["anyOf"]):
            return False
    types = node.get("type")
    types = set(types) if isinstance(types, list) else {types} if types else set()
    if types and not types & {"object", "array"}:
        return True  # a scalar type: some value exists (or the compiler says otherwise)
    if "object" in types or (not types and "properties" in node):
        props = node.get("properties") or {}
        if not all(_producible(props.get(k, {}), root, where, refs, budget) for k in node.get("required") or []):
            return "array" in types and _array_ok(node, root, where, refs, budget)
        return True
    if "array" in types:
        return _array_ok(node, root, where, refs, budget)
    return True


def _array_ok(node: dict, root: dict, where: str, refs: frozenset, budget: list) -> bool:
    n = node.get("minItems", 0) if isinstance(node.get("minItems"), int) else 0
    prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
    for i in range(n):
        sub = prefix[i] if i < len(prefix) else node.get("items", {})
        if not _producible(sub, root, where, refs, budget):
            return False
    return True
