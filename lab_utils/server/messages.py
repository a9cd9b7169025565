"""Chat messages as OpenAI's clients send them, and the conversation rules OpenAI's API enforces.

Roles: `system`, `developer` (OpenAI's newer name for system instructions; rendered as `system`), `user`,
`assistant` (its `content` may be null when it carries `tool_calls`), and `tool` (a tool's result, answering the
`tool_call_id` of a call the assistant made just before). `content` is a string or a list of text parts
(`[{"type": "text", "text": ...}]`, joined with newlines as vLLM joins them); any other part type (images,
audio, files) is refused with a message naming it: this server serves a text-only model.

`check_conversation` applies OpenAI's rules for tool messages: a `tool` message answers a call of the assistant
message right before it (only other tool messages may sit between), and every call is answered before the
conversation goes on. `for_template` turns the messages into the plain dicts a chat template reads.
"""
from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ROLES = ("system", "developer", "user", "assistant", "tool")


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


def _text_parts_only(value):
    """A list content must hold text parts only: any other part type is refused by name."""
    if isinstance(value, list):
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"content[{i}] is a {kind!r} part; this server serves a text-only model and takes "
                                 f'only text parts ({{"type": "text", "text": ...}}) or a string')
    return value


Content = str | list[TextPart]


class _Message(BaseModel):
    # clients send fields this server has no use for (e.g. `audio`); strict: each value has its JSON type
    model_config = ConfigDict(extra="ignore", strict=True)

    @field_validator("content", mode="before", check_fields=False)
    @classmethod
    def _content_parts(cls, v):
        return _text_parts_only(v)


class SystemMessage(_Message):
    role: Literal["system"]
    content: Content
    name: str | None = None


class DeveloperMessage(_Message):
    role: Literal["developer"]
    content: Content
    name: str | None = None


class UserMessage(_Message):
    role: Literal["user"]
    content: Content
    name: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str = Field(min_length=1)
    arguments: str = Field(description="the arguments as JSON text, as the model wrote them")


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True)
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    name: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _says_something(self):
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content, tool_calls or both")
        return self


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str = Field(min_length=1, description="the id of the assistant's tool call this result answers")


ChatMessage = Annotated[SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
                        Field(discriminator="role")]


class ConversationError(ValueError):
    """A conversation that breaks OpenAI's rules for tool messages; `param` names the message's field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_conversation(messages: list) -> None:
    """OpenAI's rules: each `tool` message answers a call of the assistant message before it (only tool messages
    between), and an assistant's calls are all answered before any other message."""
    open_calls: dict[str, str] = {}  # call id -> function name, of the last assistant message with tool_calls
    caller = None  # index of that message
    for i, m in enumerate(messages):
        if m.role == "tool":
            if caller is None:
                raise ConversationError(f"messages[{i}] has role 'tool' but does not follow an assistant message "
                                        f"with tool_calls: a tool message answers a tool call",
                                        f"messages.{i}.role")
            if m.tool_call_id not in open_calls:
                raise ConversationError(f"messages[{i}].tool_call_id {m.tool_call_id!r} answers no open call of "
                                        f"messages[{caller}] (open: {sorted(open_calls) or 'none'})",
                                        f"messages.{i}.tool_call_id")
            del open_calls[m.tool_call_id]
            continue
        if open_calls:
            raise ConversationError(f"messages[{caller}] made tool calls that no tool message answers before "
                                    f"messages[{i}]: {sorted(open_calls)}; send one tool message per call, with its "
                                    f"tool_call_id", f"messages.{i}")
        caller = None
        if m.role == "assistant" and m.tool_calls:
            ids = [c.id for c in m.tool_calls]
            if len(set(ids)) != len(ids):
                raise ConversationError(f"messages[{i}].tool_calls repeats an id: {ids}", f"messages.{i}.tool_calls")
            open_calls, caller = {c.id: c.function.name for c in m.tool_calls}, i
    if open_calls:
        raise ConversationError(f"messages[{caller}] made tool calls that no tool message answers: "
                                f"{sorted(open_calls)}; send one tool message per call, with its tool_call_id",
                                f"messages.{caller}.tool_calls")


def text_of(content) -> str | None:
    """A message's content as one string (text parts joined with newlines), None if it has none."""
    if content is None or isinstance(content, str):
        return content
    return "\n".join(p.text for p in content)


def arguments_value(arguments: str):
    """A call's arguments as a JSON value when they parse (chat templates expect a mapping), else the text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def for_template(messages: list) -> list[dict]:
    """Plain dicts for `tokenizer.apply_chat_template`: text content, developer as system, tool calls with their
    arguments parsed, tool results with the name of the function they answer."""
    names = {c.id: c.function.name for m in messages if m.role == "assistant" for c in (m.tool_calls or [])}
    out = []
    for m in messages:
        d: dict = {"role": "system" if m.role == "developer" else m.role, "content": text_of(m.content)}
        if getattr(m, "name", None):
            d["name"] = m.name
        if m.role == "assistant" and m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name,
                                             "arguments": arguments_value(c.function.arguments)}}
                               for c in m.tool_calls]
        if m.role == "tool":
            d["tool_call_id"], d["name"] = m.tool_call_id, names.get(m.tool_call_id)
        out.append(d)
    return out


def size_of(messages: list[dict]) -> int:
    """Characters to render (decides whether rendering runs off the event loop)."""
    return sum(len(m.get("content") or "") + len(json.dumps(m.get("tool_calls") or [])) for m in messages)
