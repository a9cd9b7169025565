"""What a request asks its output to look like: a JSON schema, any JSON object, a regex, one of a list of
strings, or a grammar. Names follow vLLM's `StructuredOutputsParams`, so a request means the same in both.

Plain data, no grammar library: `SamplingParams` imports it, and the engine only compiles it
(`lab_utils.structured.hook`) when a request carries one.
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputParams:
    json: str | dict | None = None  # a JSON schema (dict or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF-style, `root ::= ...`) or Lark
    json_object: bool | None = None  # any JSON object
    # vLLM's switch of the same name: no free whitespace between JSON tokens (a small model given the freedom
    # can loop on newlines until max_tokens)
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_output needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if isinstance(self.json, str):
            try:
                parsed = _json.loads(self.json)
            except ValueError as err:
                raise ValueError(f"structured_output.json is not valid JSON ({err}); pass a JSON schema as a "
                                 f"dict or its JSON text") from None
            if not isinstance(parsed, dict):
                raise ValueError(f"structured_output.json must be a JSON schema object, got {type(parsed).__name__}")
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_output.json must be a dict or JSON text, got {type(self.json).__name__}")
        if self.choice is not None:
            if (isinstance(self.choice, str) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured_output.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            self.choice = list(self.choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured_output.{name} must be a non-empty string, got {value!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """What identifies the compiled grammar (equal keys share one compilation)."""
        spec = getattr(self, self.kind)
        if isinstance(spec, dict):
            spec = _json.dumps(spec, sort_keys=True)
        elif isinstance(spec, list):
            spec = tuple(spec)
        return self.kind, spec, self.disable_any_whitespace

    @classmethod
    def coerce(cls, value) -> "StructuredOutputParams | None":
        """None, an instance, or a dict of its fields (e.g. {"json": schema})."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"structured_output has unknown field(s) {sorted(unknown)}; the fields are "
                                 f"{sorted(cls.__dataclass_fields__)}")
            return cls(**value)
        raise ValueError(f"structured_output must be a StructuredOutputParams or a dict like "
                         f"{{'json': schema}}, got {type(value).__name__}")
