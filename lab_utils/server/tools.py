"""OpenAI's `response_format` and `tools` / `tool_choice`, mapped onto the engine's structured output as vLLM's
server maps them:

- `response_format={"type": "json_object"}` -> any JSON object; `{"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}}}` -> that schema.
- `tool_choice={"type": "function", "function": {"name": f}}` -> the output is f's arguments (f's `parameters`
  schema); the reply carries one tool call to f, finish_reason "stop".
- `tool_choice="required"` -> the output is a JSON array of {"name": <a tool>, "parameters": {...}} (vLLM's
  format): with parallel calls allowed, one to len(tools) calls, each tool at most once and in the order `tools`
  lists them (a grammar: `distinct_calls_grammar`), so a model that would repeat a call must close the array
  and the reply ends with `tool_calls`; with `parallel_tool_calls=false`, exactly one call. finish_reason
  "tool_calls". A reply cut by max_tokens keeps its complete calls (finish_reason "length").
- `tool_choice="auto"` (the default when tools are given) -> no constraint: the model decides. The tools are
  shown to it (the chat template's `tools`, or a system message in the Hermes format when the template has no
  place for them), and a reply that holds `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (or just such
  a JSON object) becomes tool calls, as vLLM's `hermes` tool parser reads them; anything else is content.
- `tool_choice="none"` -> tools are ignored.
The conversation's earlier tool calls and tool results (messages.py) are rendered by the template when it knows
them, else in the same Hermes text (`render_chat`), so the model reads them in the format it is asked to write.
JSON is generated without free whitespace between tokens (vLLM's `disable_any_whitespace`, a server-wide switch
there): given the freedom, a small model can emit newlines until max_tokens. A schema the grammar compiler
cannot take is a 400 naming the problem (the engine's ValueError).
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
COMPACT = {"disable_any_whitespace": True}


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore", strict=True)
    name: str = Field(pattern=NAME_PATTERN)
    json_schema: dict = Field(alias="schema")  # "schema" shadows a pydantic attribute, hence the alias
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str = Field(pattern=NAME_PATTERN)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolRequestError(ValueError):
    """A request whose response_format / tools / tool_choice cannot be served; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _params(fn: FunctionDef) -> dict:
    return fn.parameters or {"type": "object", "properties": {}}


def tool_mode(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> str | None:
    """None (no tools in play), "auto", "required" or "function:<name>"."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise ToolRequestError("tool_choice needs tools: pass the functions the model may call in `tools`",
                               "tool_choice")
    if not tools or tool_choice == "none":
        return None
    if isinstance(tool_choice, NamedToolChoice):
        names = [t.function.name for t in tools]
        if tool_choice.function.name not in names:
            raise ToolRequestError(f"tool_choice names {tool_choice.function.name!r}, which is not in tools "
                                   f"({', '.join(names)})", "tool_choice")
        return f"function:{tool_choice.function.name}"
    return tool_choice or "auto"


def structured_output(response_format: ResponseFormat | None, tools: list[Tool] | None, mode: str | None,
                      parallel_tool_calls: bool | None = None) -> dict | None:
    """The engine's `structured_output` for this request (None: unconstrained)."""
    forced = mode is not None and mode != "auto"
    if response_format is not None and response_format.type != "text" and forced:
        raise ToolRequestError("response_format and a forced tool_choice both constrain the output: send one of "
                               "them", "response_format")
    if forced:
        if mode == "required":
            if parallel_tool_calls is not False:
                return {"grammar": distinct_calls_grammar(tools)}
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "object", "anyOf": [
                {"properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": _params(t.function)},
                 "required": ["name", "parameters"]} for t in tools]}}
            return {"json": schema, **COMPACT}
        name = mode.split(":", 1)[1]
        return {"json": _params(next(t.function for t in tools if t.function.name == name)), **COMPACT}
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"json_object": True, **COMPACT}
    if response_format.json_schema is None:
        raise ToolRequestError('response_format of type "json_schema" needs "json_schema": {"name": ..., '
                               '"schema": {...}}', "response_format")
    return {"json": response_format.json_schema.json_schema, **COMPACT}


def distinct_calls_grammar(tools: list[Tool]) -> str:
    """EBNF for `[call, ...]`: at least one call, each tool at most once, in the order of `tools` (so the calls
    are distinct and at most len(tools): the array must close). Each call is `{"name":"<name>","parameters":
    <its parameters' grammar>}`, the parameters narrowed as a `response_format` schema is (structured/schema.py).
    Linear in the tools: `seq_i` is call i then any later calls in order, each optional."""
    import xgrammar as xgr

    from lab_utils.structured.schema import prepare_schema

    def literal(text: str):
        return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")

    calls = []
    for i, t in enumerate(tools):
        try:
            params = xgr.Grammar.from_json_schema(json.dumps(prepare_schema(_params(t.function))),
                                                  any_whitespace=False, separators=(",", ":"))
        except RuntimeError as err:  # the compiler's refusal (the server compiles each tool alone first)
            raise ToolRequestError(f"tools[{i}].function.parameters could not be compiled: {err}", "tools") from None
        calls.append(xgr.Grammar.concat(literal(f'{{"name":"{t.function.name}","parameters":'), params, literal("}")))
    lines = str(xgr.Grammar.union(*calls, literal(""))).splitlines()  # "" keeps the union a union when n == 1
    call_rules = re.findall(r"\((\w+)\)", lines[0])[:len(tools)]  # root ::= ((root_1) | (root_2) | ...)
    if not lines[0].startswith("root ::=") or len(call_rules) != len(tools):
        raise RuntimeError(f"unexpected xgrammar union: {lines[0][:200]!r}")
    n = len(tools)
    ours = [f"root ::= \"[\" ({' | '.join(f'tc_seq_{i}' for i in range(n))}) \"]\""]
    ours += [f"tc_seq_{i} ::= {call_rules[i]}" + (f" tc_tail_{i + 1}" if i + 1 < n else "") for i in range(n)]
    ours += [f"tc_tail_{j} ::= (\"\" | (\",\" {call_rules[j]}))" + (f" tc_tail_{j + 1}" if j + 1 < n else "")
             for j in range(1, n)]
    return "\n".join([*lines[1:], *ours])


def complete_calls(text: str) -> list[dict]:
    """The whole `{"name", "parameters"}` items at the start of a JSON array cut short (max_tokens)."""
    decoder, items, at = json.JSONDecoder(), [], 1
    if not text.startswith("["):
        return []
    while True:
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            return items
        if not (isinstance(item, dict) and "name" in item and "parameters" in item):
            return items
        items.append(item)
        if text[at:at + 1] != ",":
            return items
        at += 1


def tool_schema(tool: Tool) -> dict:
    """The structured output of one tool's arguments alone (its `$ref`s resolved against its own parameters)."""
    return {"json": _params(tool.function), **COMPACT}


# -- the prompt -----------------------------------------------------------------------------------------------
TOOLS_SYSTEM = ("You may call functions. They are listed as JSON inside <tools></tools>:\n<tools>\n{lines}\n</tools>\n"
                "To call one, reply with <tool_call>{{\"name\": <function name>, \"arguments\": <arguments object>}}"
                "</tool_call>.")


def render_chat(tokenizer, messages: list[dict], tools: list[Tool] | None, mode: str | None) -> str:
    """The chat prompt (`messages` as `messages.for_template` gives them), with the tools shown to the model
    when it must choose or fill them. A template that knows tool calls and tool results renders them itself;
    for one that does not (it fails on them, or leaves them out), they are written in the Hermes format the
    tools' system message asks the model to use: `<tool_call>{...}</tool_call>` in the assistant's turn and
    `<tool_response>...</tool_response>` in a user turn."""
    specs = [t.model_dump(exclude_none=True) for t in tools] if mode is not None else None
    try:
        prompt = _apply(tokenizer, messages, None)
        if _shows_tool_turns(prompt, messages):
            return prompt if specs is None else _with_tools(tokenizer, messages, specs, prompt) or \
                _apply(tokenizer, _tools_system(specs, messages), None)
    except Exception:  # noqa: BLE001 - a template without tool turns (e.g. content None): the Hermes text below
        if not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            raise  # the template refuses these messages for another reason: the client's to fix
    hermes = _hermes_turns(messages)
    if specs is None:
        return _apply(tokenizer, hermes, None)
    return _with_tools(tokenizer, hermes, specs, _apply(tokenizer, hermes, None)) or \
        _apply(tokenizer, _tools_system(specs, hermes), None)


def _with_tools(tokenizer, messages: list[dict], specs: list[dict], plain: str) -> str | None:
    """The prompt with the template's own place for `tools`, None if it has none (it ignores or refuses them)."""
    try:
        prompt = _apply(tokenizer, messages, specs)
    except Exception:  # noqa: BLE001 - a template that refuses `tools`
        return None
    placed = prompt != plain and all(s["function"]["name"] in prompt for s in specs)
    return prompt if placed else None


def _tools_system(specs: list[dict], messages: list[dict]) -> list[dict]:
    """The tools in a system message of their own, after the client's system text when there is one."""
    tools = TOOLS_SYSTEM.format(lines="\n".join(json.dumps(s) for s in specs))
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{tools}"}, *messages[1:]]
    return [{"role": "system", "content": tools}, *messages]


def _apply(tokenizer, messages: list[dict], specs: list[dict] | None) -> str:
    extra = {} if specs is None else {"tools": specs}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)


def _shows_tool_turns(prompt: str, messages: list[dict]) -> bool:
    """Whether the template wrote every tool call's name and arguments and every tool result into the prompt."""
    for m in messages:
        for c in m.get("tool_calls") or []:
            args = c["function"]["arguments"]
            if c["function"]["name"] not in prompt or not _written(args, prompt):
                return False
        if m["role"] == "tool" and (m["content"] or "") not in prompt:
            return False
    return True


def _written(args, prompt: str) -> bool:
    if isinstance(args, str):
        return args in prompt
    return all(json.dumps(v)[:40].strip('"') in prompt for v in (args.values() if isinstance(args, dict) else [args]))


def _hermes_turns(messages: list[dict]) -> list[dict]:
    """Tool calls and results as text, in the Hermes format (as Qwen's and NousResearch's templates write them):
    consecutive tool results share one user turn."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        d = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id", "name")}
        if m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                            "arguments": c["function"]["arguments"]}) + "\n</tool_call>"
                              for c in m["tool_calls"])
            d["content"] = f"{m['content']}\n{calls}" if m.get("content") else calls
        out.append(d)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


# -- the reply --------------------------------------------------------------------------------------------------
TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _call(name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def parse_tool_calls(text: str, tools: list[Tool]) -> list[dict]:
    """Tool calls in a free ("auto") reply: Hermes `<tool_call>{...}</tool_call>` blocks, or the whole reply as
    one such JSON object (or a list of them). Only calls to known tools count."""
    names = {t.function.name for t in tools}
    blobs = TOOL_CALL_RE.findall(text) or [text.strip()]
    calls = []
    for blob in blobs:
        try:
            value = json.loads(blob)
        except ValueError:
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict) and item.get("name") in names:
                calls.append(_call(item["name"], item.get("arguments", item.get("parameters", {}))))
    return calls


def chat_reply(text: str, mode: str | None, tools: list[Tool] | None, finish_reason: str | None
               ) -> tuple[dict, str | None]:
    """The assistant message (content or tool_calls) and the finish_reason, as OpenAI's API returns them."""
    if mode == "required" and finish_reason == "length":  # the calls written whole before the cut
        calls = [_call(c["name"], c["parameters"]) for c in complete_calls(text)]
        if calls:
            return {"role": "assistant", "content": None, "tool_calls": calls}, finish_reason
    if mode is None or finish_reason == "length":
        return {"role": "assistant", "content": text}, finish_reason
    if mode.startswith("function:"):  # the output *is* the arguments
        return {"role": "assistant", "content": None, "tool_calls": [_call(mode.split(":", 1)[1], text)]}, "stop"
    if mode == "required":
        calls = [_call(c["name"], c["parameters"]) for c in json.loads(text)]
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
    calls = parse_tool_calls(text, tools)
    if calls:
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": text}, finish_reason
