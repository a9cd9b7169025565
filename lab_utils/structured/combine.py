"""`allOf` and `oneOf` rewritten into what the grammar compiler enforces.

The compiler (xgrammar) does not intersect schemas (an `allOf` of several members, or with keywords beside it,
compiles to "any JSON value") and reads `oneOf` as `anyOf` (it cannot enforce "exactly one"). So:

- `allOf` is merged into one schema, keyword by keyword, whose values are exactly those valid for every member:
  types intersected, `properties` merged key by key (a key one member's `additionalProperties` forbids is
  dropped, or the schema refused if it is required), items position by position (`prefixItems`, then `items`), `required` joined, the tighter of two bounds kept,
  `enum`/`const` intersected, a `$ref` member inlined. Two members that set one keyword to different values
  the merge cannot intersect (two `pattern`s, two `prefixItems`, two `anyOf`) are refused by name.
- `oneOf` becomes `anyOf` of its branches, each merged with the keywords beside it, when no value can meet two
  branches: a value generated under branch i (as narrowed for generation) provably fails every other branch as
  sent, by its type, its `const`/`enum`, a key the other requires and branch i never writes, or a required
  property whose values the other's excludes. Branches that may overlap are refused, naming them.
- the keywords beside an `anyOf` are merged into each of its branches (the compiler reads only the `anyOf`).
"""
from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable

from lab_utils.structured.pointer import resolve

ANNOTATIONS = {"title", "description", "$comment", "default", "examples", "$schema", "deprecated", "readOnly",
               "writeOnly"}
LOWER_BOUNDS = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains")
UPPER_BOUNDS = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains")
MAX_INLINE_DEPTH = 16  # $ref members inlined inside $ref members: deeper is refused (a cycle through allOf)


def flatten_all_of(node: dict, root: dict, where: str, unsupported: type[ValueError],
                   unsatisfiable: type[ValueError], depth: int = 0) -> dict:
    """`node` with its `allOf` (and its members' own, and inlined `$ref` members) merged into it."""
    if depth > MAX_INLINE_DEPTH:
        raise unsupported(f"{where}: allOf nests $ref members more than {MAX_INLINE_DEPTH} deep (a cycle?)")
    members = node.get("allOf")
    if not isinstance(members, list):
        raise unsupported(f"{where}: allOf must be a list of schemas")
    keep = {k: v for k, v in node.items() if k in ("$defs", "definitions")}  # where references resolve: stays
    out = {k: v for k, v in node.items() if k != "allOf" and k not in keep}
    merge = _Merge(root, unsupported, unsatisfiable, depth)
    for i, member in enumerate(members):
        out = merge.both(out, member, f"{where}/allOf/{i}")
    return {**keep, **out}


def one_of_as_any_of(node: dict, root: dict, where: str, narrow: Callable[[dict, str], dict],
                     unsupported: type[ValueError], unsatisfiable: type[ValueError]) -> dict:
    """`node` with `oneOf` replaced by an `anyOf` of narrowed, pairwise disjoint branches (each merged with the
    keywords beside `oneOf`); `narrow(schema, where)` narrows a branch as the walker does (or raises
    `unsatisfiable`: that branch is dropped)."""
    branches = node.get("oneOf")
    if not isinstance(branches, list):
        raise unsupported(f"{where}: oneOf must be a list of schemas")
    keep = {k: v for k, v in node.items() if k in ("$defs", "definitions") or k in ANNOTATIONS}
    beside = {k: v for k, v in node.items() if k not in keep and k != "oneOf"}
    merge = _Merge(root, unsupported, unsatisfiable, 0)
    sent, narrowed, last_why = {}, {}, None
    for i, branch in enumerate(branches):
        here = f"{where}/oneOf/{i}"
        try:
            sent[i] = merge.both(copy.deepcopy(beside), branch, here)
        except unsatisfiable as why:  # no value meets this branch (as sent): it can never be the one
            last_why = why
            continue
        try:
            narrowed[i] = narrow(copy.deepcopy(sent[i]), here)
        except unsatisfiable as why:  # nothing to generate from it, yet values of the others may still meet it
            last_why = why
    if not narrowed:
        raise last_why or unsatisfiable(f"{where}: oneOf has no branch")
    for i, made in narrowed.items():
        for j, other in sent.items():
            if i != j and not excludes(made, other, root):
                raise unsupported(
                    f"{where}: oneOf branches {i} and {j} may both match one value (the grammar cannot enforce "
                    f"'exactly one'); make them disjoint (different types, different const values of a required "
                    f"property, or a required key the other does not name) or use anyOf")
    return {**keep, "anyOf": list(narrowed.values())}


def distribute_any_of(node: dict, root: dict, where: str, unsupported: type[ValueError],
                      unsatisfiable: type[ValueError]) -> dict:
    """`node`'s keywords beside `anyOf` merged into each branch (the compiler reads only the `anyOf` of a
    schema that has one): `S and anyOf(B...)` is `anyOf(S and B...)`; a branch no value meets is dropped."""
    keep = {k: v for k, v in node.items() if k in ("$defs", "definitions") or k in ANNOTATIONS}
    beside = {k: v for k, v in node.items() if k not in keep and k != "anyOf"}
    merge = _Merge(root, unsupported, unsatisfiable, 0)
    branches, last_why = [], None
    for i, branch in enumerate(node["anyOf"]):
        try:
            branches.append(merge.both(copy.deepcopy(beside), branch, f"{where}/anyOf/{i}"))
        except unsatisfiable as why:
            last_why = why
    if not branches:
        raise last_why or unsatisfiable(f"{where}: anyOf has no branch")
    return {**keep, "anyOf": branches}


# -- disjointness: every value `made` (a narrowed schema) admits fails `other` (as sent) -------------------
def excludes(made, other, root: dict, depth: int = 0) -> bool:
    if depth > MAX_INLINE_DEPTH or not isinstance(made, dict):
        return False
    if other is False:
        return True
    if not isinstance(other, dict):
        return False
    if isinstance(other.get("$ref"), str) and set(other) <= {"$ref"} | ANNOTATIONS:
        try:
            return excludes(made, resolve(root, other["$ref"]), root, depth + 1)
        except (KeyError, ValueError):
            return False
    if isinstance(made.get("anyOf"), list) and made["anyOf"] and all(
            excludes(sub, other, root, depth + 1) for sub in made["anyOf"]):
        return True  # every value made admits meets one of its branches
    if isinstance(other.get("anyOf"), list) and other["anyOf"] and all(
            excludes(made, sub, root, depth + 1) for sub in other["anyOf"]):
        return True  # a value of other meets one of its branches
    values = _values(made)
    if values is not None:
        return all(_fails(v, other) for v in values)
    made_types, other_types = _types(made), _types(other)
    if made_types and other_types and not any(_admits(other_types, t) for t in made_types):
        return True
    other_values = _values(other)
    if other_values is not None and made_types and not any(_admits(made_types, _json_type(v)) for v in other_values):
        return True
    if made_types == {"object"}:
        written = made.get("properties") or {}  # narrowed: the only keys ever written
        if any(isinstance(k, str) and k not in written for k in other.get("required") or []):
            return True
        theirs = other.get("properties") or {}
        for k in made.get("required") or []:
            if k in theirs and excludes(written.get(k), theirs[k], root, depth + 1):
                return True
    return False


def _fails(value, other: dict) -> bool:
    """`value` certainly fails `other` (by type, const/enum or a required key it lacks)."""
    types = _types(other)
    if types and not _admits(types, _json_type(value)):
        return True
    values = _values(other)
    if values is not None and _canon(value) not in {_canon(v) for v in values}:
        return True
    if isinstance(value, dict):
        if any(isinstance(k, str) and k not in value for k in other.get("required") or []):
            return True
        theirs = other.get("properties") or {}
        return any(k in theirs and isinstance(theirs[k], dict) and _fails(v, theirs[k]) or theirs.get(k) is False
                   for k, v in value.items())
    return False


def _types(schema: dict) -> set[str] | None:
    t = schema.get("type")
    if t is None:
        return None
    return set(t) if isinstance(t, list) else {t}


def _admits(types: set[str], t: str) -> bool:
    """A value of JSON type `t` may be of one of `types` (integers are numbers; a number may be integral)."""
    return t in types or (t == "integer" and "number" in types) or (t == "number" and "integer" in types)


def _json_type(v) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(v), "null")


def _values(schema: dict) -> list | None:
    if "const" in schema:
        return [schema["const"]]
    if isinstance(schema.get("enum"), list):
        return schema["enum"]
    return None


def _canon(v) -> str:
    """JSON Schema's equality as a string: 1 and 1.0 equal, true and 1 not, keys in any order."""
    def norm(x):
        if isinstance(x, float) and x.is_integer():
            return int(x)
        if isinstance(x, list):
            return [norm(y) for y in x]
        if isinstance(x, dict):
            return {k: norm(y) for k, y in x.items()}
        return x
    return json.dumps(norm(v), sort_keys=True)


# -- the merge of two schemas: values valid for both -----------------------------------------------------
class _Merge:
    def __init__(self, root: dict, unsupported, unsatisfiable, depth: int) -> None:
        self.root, self.unsupported, self.unsatisfiable, self.depth = root, unsupported, unsatisfiable, depth

    def member(self, schema, where: str):
        """A member ready to merge: booleans as they are; `$ref` inlined, its own allOf merged."""
        if isinstance(schema, bool):
            return schema
        if not isinstance(schema, dict):
            raise self.unsupported(f"{where}: a schema must be an object or a boolean")
        if "$id" in schema:
            raise self.unsupported(f"{where}: '$id' inside allOf / oneOf is not supported")
        schema = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}  # refs resolve at the root
        if isinstance(schema.get("$ref"), str):
            ref = schema.pop("$ref")
            if not (ref == "#" or ref.startswith("#/")):
                raise self.unsupported(f"{where}: $ref {ref!r} is not supported: only references inside this schema")
            try:
                target = copy.deepcopy(resolve(self.root, ref))
            except (KeyError, IndexError, ValueError, TypeError):
                raise self.unsupported(f"{where}: $ref {ref!r} points to nothing in this schema") from None
            deeper = _Merge(self.root, self.unsupported, self.unsatisfiable, self.depth + 1)
            if self.depth + 1 > MAX_INLINE_DEPTH:
                raise self.unsupported(f"{where}: allOf / oneOf inline $ref more than {MAX_INLINE_DEPTH} deep "
                                       f"(a cycle?)")
            return deeper.both(deeper.member(target, where), schema, where)
        if "allOf" in schema:
            return flatten_all_of(schema, self.root, where, self.unsupported, self.unsatisfiable, self.depth + 1)
        return schema

    def both(self, a, b, where: str):
        """One schema whose values are exactly those valid for `a` and for `b` (or a refusal)."""
        a, b = self.member(a, where), self.member(b, where)
        if a is False or b is False:
            raise self.unsatisfiable(f"{where}: the schema false admits no value")
        if a is True:
            return b
        if b is True:
            return a
        out = dict(a)
        for key, value in b.items():
            if key in ANNOTATIONS and key in out:
                continue
            if key not in out:
                out[key] = value
            elif _canon(out[key]) == _canon(value) and key not in ("properties", "additionalProperties"):
                continue
            elif key == "type":
                out[key] = self.types(out[key], value, where)
            elif key in LOWER_BOUNDS:
                out[key] = max(out[key], value)
            elif key in UPPER_BOUNDS:
                out[key] = min(out[key], value)
            elif key in ("enum", "const"):
                continue  # below, with both sides' values
            elif key == "required":
                out[key] = list(dict.fromkeys([*out[key], *value]))
            elif key == "multipleOf" and all(isinstance(x, int) and not isinstance(x, bool) for x in (out[key], value)):
                out[key] = math.lcm(out[key], value)
            elif key == "uniqueItems":
                out[key] = bool(out[key]) or bool(value)
            elif key not in ("properties", "additionalProperties", "items", "prefixItems"):
                raise self.unsupported(f"{where}: allOf members set {key!r} differently ({json.dumps(out[key])} "
                                       f"and {json.dumps(value)}), which cannot be merged; merge them into one")
        if {"properties", "additionalProperties", "required"} & (a.keys() | b.keys()):
            self.objects(a, b, out, where)
        if {"items", "prefixItems"} & (a.keys() | b.keys()):
            self.arrays(a, b, out, where)
        if _values(a) is not None or _values(b) is not None:
            self.values(a, b, out, where)
        return out

    def types(self, x, y, where: str):
        xs, ys = (set(t) if isinstance(t, list) else {t} for t in (x, y))
        both = (xs & ys) | ({"integer"} if ("integer" in xs and "number" in ys) or ("number" in xs and "integer" in ys)
                            else set())
        if not both:
            raise self.unsatisfiable(f"{where}: no value is of type {json.dumps(x)} and of type {json.dumps(y)}")
        return next(iter(both)) if len(both) == 1 else sorted(both)

    def objects(self, a: dict, b: dict, out: dict, where: str) -> None:
        """properties key by key: each side's schema for a key is its `properties[key]`, else its
        `additionalProperties` (JSON Schema reads additionalProperties against its own schema's properties)."""
        required = out.get("required") or []
        keys = [*(a.get("properties") or {}), *(b.get("properties") or {}), *(k for k in required if isinstance(k, str))]
        props = {}
        for key in dict.fromkeys(keys):
            sides = [(s.get("properties") or {}).get(key, s.get("additionalProperties", True)) for s in (a, b)]
            try:
                props[key] = self.both(sides[0], sides[1], f"{where}/properties/{key}")
            except self.unsatisfiable:
                if key in required:
                    raise self.unsatisfiable(f"{where}: {key!r} is required, but no value meets both allOf members' "
                                             f"schemas for it (additionalProperties: false forbids it?)") from None
        out["properties"] = props
        extra = [s.get("additionalProperties", True) for s in (a, b)]
        try:
            out["additionalProperties"] = self.both(extra[0], extra[1], f"{where}/additionalProperties")
        except self.unsatisfiable:
            out["additionalProperties"] = False

    def arrays(self, a: dict, b: dict, out: dict, where: str) -> None:
        """Items position by position: each side's schema for position k is its `prefixItems[k]`, else its
        `items` (which reads past its own schema's prefixItems only)."""
        prefixes = [s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else [] for s in (a, b)]
        tails = [s.get("items", True) for s in (a, b)]
        n = max(len(p) for p in prefixes)
        at = [[p[k] if k < len(p) else tail for p, tail in zip(prefixes, tails)] for k in range(n)]
        merged = []
        for k, (x, y) in enumerate(at):
            try:
                merged.append(self.both(x, y, f"{where}/prefixItems/{k}"))
            except self.unsatisfiable:  # no item fits position k: the array ends before it
                out["maxItems"] = min(out.get("maxItems", k), k)
                break
        if merged:
            out["prefixItems"] = merged
        else:
            out.pop("prefixItems", None)
        try:
            out["items"] = self.both(tails[0], tails[1], f"{where}/items")
        except self.unsatisfiable:
            out["items"] = False
        if out["items"] is True:
            del out["items"]

    def values(self, a: dict, b: dict, out: dict, where: str) -> None:
        va, vb = _values(a), _values(b)
        out.pop("const", None)
        if va is not None and vb is not None:
            theirs = {_canon(v) for v in vb}
            va = [v for v in va if _canon(v) in theirs]
        values = [v for v in (va if va is not None else vb) if not _fails(v, {k: x for k, x in out.items()
                                                                               if k not in ("enum", "const")})]
        if not values:
            raise self.unsatisfiable(f"{where}: no value of the allOf members' const / enum meets them all")
        out["enum"] = values
