"""`$ref`s inside one schema ("#", "#/$defs/a~1b", "#/$defs/a%20b"), read as JSON Schema reads them: the part
after "#" is a URI fragment, so it is percent-decoded first ("%20" is a space, "%25" a percent sign), and the
JSON Pointer that results (RFC 6901) is split at "/", each key unescaped ("~1" is "/", then "~0" is "~", so
"~01" is the key "~1").

The grammar compiler (xgrammar) splits a `$ref` at "/" and decodes nothing, so `plain_refs` points every `$ref`
that needs decoding at a copy of its target under `$defs` with a plain name.
"""
from __future__ import annotations

import re
from urllib.parse import unquote

PLAIN_KEY = re.compile(r"^[A-Za-z0-9_$.-]+$")  # a key xgrammar finds as written


def pointer_keys(ref: str) -> list[str]:
    """The keys a local `$ref` walks from the root; ValueError naming what is wrong with it."""
    if not ref.startswith("#"):
        raise ValueError(f"$ref {ref!r} is not supported: only references inside this schema ('#' or '#/...')")
    pointer = unquote(ref[1:], errors="strict")
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise ValueError(f"$ref {ref!r} is not supported: only JSON Pointers ('#/$defs/name'), not anchors")
    keys = []
    for raw in pointer[1:].split("/"):
        if re.search(r"~(?![01])", raw):
            raise ValueError(f"$ref {ref!r}: '~' must be followed by 0 or 1 in a JSON Pointer (RFC 6901)")
        keys.append(raw.replace("~1", "/").replace("~0", "~"))
    return keys


def resolve(root, ref: str):
    """The subschema `ref` points at inside `root`; ValueError if it points to nothing."""
    node = root
    for key in pointer_keys(ref):
        if isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        elif isinstance(node, dict) and key in node:
            node = node[key]
        else:
            raise ValueError(f"$ref {ref!r} points to nothing in this schema")
    return node


def needs_decoding(ref: str) -> bool:
    """Whether the compiler, which reads a `$ref` as written, would look for other keys than JSON Schema's."""
    return ref != "#" and not all(PLAIN_KEY.match(k) for k in ref[2:].split("/"))


def plain_refs(root: dict) -> dict:
    """`root` with each `$ref` that needs decoding pointed at `#/$defs/<plain name>`, that name holding its target
    (the same subschema, so the language is unchanged). A `$ref` that points to nothing is left as it is."""
    nodes, seen, stack = [], set(), [root]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, dict):
            if isinstance(x.get("$ref"), str) and needs_decoding(x["$ref"]):
                nodes.append(x)
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    if not nodes:
        return root
    defs = root.setdefault("$defs", {})
    if not isinstance(defs, dict):
        return root
    names: dict[str, str] = {}
    for node in nodes:
        ref = node["$ref"]
        if ref not in names:
            try:
                target = resolve(root, ref)
            except ValueError:
                continue
            name = next(f"ref{i}" for i in range(len(defs) + 1) if f"ref{i}" not in defs)
            defs[name], names[ref] = target, name
        node["$ref"] = f"#/$defs/{names[ref]}"
    return root
