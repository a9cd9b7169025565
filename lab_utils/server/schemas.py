"""The request bodies of /v1/completions and /v1/chat/completions, one field per line (so a new field is one line).

Every field is checked here, before the engine sees it: a bad value is a 400 naming the field. OpenAI fields this
server does not implement are refused unless their value asks for nothing (`NOT_IMPLEMENTED`), never silently
ignored.
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictFloat, StringConstraints, ValidationInfo,
                      WithJsonSchema, field_validator)

from lab_utils.engine.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_STRINGS, PENALTY_RANGE, SEED_RANGE
from lab_utils.server.messages import ChatMessage
from lab_utils.server.streaming import StreamOptions
from lab_utils.server.tools import NamedToolChoice, ResponseFormat, Tool

StopString = Annotated[str, StringConstraints(min_length=1, max_length=256)]
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0  # past these a logit leaves float32's range
TOKEN_ID_KEY = r"^[0-9]+$"  # a logit_bias key: a token id in decimal digits


def _json_int(v):
    """JSON Schema's integer: 4.0 is the integer 4 (strict mode refuses "4" and true)."""
    return int(v) if type(v) is float and v.is_integer() else v


def json_int(**bounds):
    """An integer field with its bounds (ge, le), JSON Schema's way: the bounds go before the validator, so the
    OpenAPI schema states them as minimum / maximum."""
    return Annotated[int, Field(**bounds), BeforeValidator(_json_int)]


TokenId = json_int()  # its bounds (this model's vocabulary) are the engine's check; openapi.py publishes them
LOGIT_BIAS_SCHEMA = {"anyOf": [{"type": "object", "propertyNames": {"pattern": TOKEN_ID_KEY},
                                "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS,
                                                         "maximum": MAX_LOGIT_BIAS}}, {"type": "null"}],
                     "default": None, "description": "token id (decimal digits) -> bias in [-100, 100]"}
# OpenAI fields this server does not implement (top_logprobs on /v1/completions, echo on chat: not fields of those
# endpoints), with the values that ask for nothing (accepted; none: only null is); any other value is a 400 naming
# the field, never silently ignored
NOT_IMPLEMENTED = {"best_of": (1,), "suffix": ("",), "top_logprobs": (0,), "echo": (False,),
                   "functions": (), "function_call": (), "modalities": (["text"],), "audio": (), "prediction": (),
                   "web_search_options": (), "service_tier": ("auto", "default"), "reasoning_effort": ("none",),
                   "store": (False,), "verbosity": (), "moderation": (), "prompt_cache_options": (),
                   "prompt_cache_retention": ()}
REFUSAL_HINTS = {"functions": "; describe them as tools instead", "function_call": "; use tool_choice instead"}


def _refuse(v, info: ValidationInfo):
    name, neutral = info.field_name, NOT_IMPLEMENTED[info.field_name]
    if v is None or any(v == n and (type(v) is bool) == (type(n) is bool) for n in neutral):  # 1 is not true
        return None
    send = " or send " + " or ".join(json.dumps(n) for n in neutral) if neutral else ""
    raise ValueError(f"{v!r} is not supported by this server; omit {name}{send}{REFUSAL_HINTS.get(name, '')}")


Unsupported = Annotated[Any, BeforeValidator(_refuse)]
Penalty = Annotated[StrictFloat | None, Field(default=None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1],
                                              allow_inf_nan=False, description="in [-2, 2]; 0 or null: off")]


# the fields both endpoints take (a comment, not a docstring: pydantic would put a docstring in the schema)
class CommonFields(BaseModel):
    # strict: a field's value has its JSON type ("1" is not a number, 1 is not true), as the OpenAPI schema says
    model_config = ConfigDict(extra="ignore", strict=True)  # other clients' extension fields

    model: str
    max_tokens: json_int(ge=1) | None = Field(default=None, description="capped at the server's --max-tokens-cap")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False,
                               description="0: greedy; above 0 at least 0.01 (vLLM's floor)")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: json_int(ge=-1) = Field(default=0, description="0 or -1: off")
    seed: json_int(ge=SEED_RANGE[0], le=SEED_RANGE[1]) | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = Field(default=None, description="only with stream: true")
    return_token_ids: bool = Field(default=False, description="vLLM's: each choice carries its token ids (each "
                                                              "chunk the new ones), and the prompt's are returned")
    ignore_eos: bool = False
    n: json_int(ge=1, le=1) = Field(default=1, description="one choice per request")
    response_format: ResponseFormat | None = None  # {"type": "json_object"} | {"type": "json_schema", ...}
    # the sampler's logit processors (vLLM's definitions; docs/SERVER.md)
    logit_bias: Annotated[dict[int, float] | None, WithJsonSchema(LOGIT_BIAS_SCHEMA)] = None
    frequency_penalty: Penalty
    presence_penalty: Penalty
    repetition_penalty: StrictFloat | None = Field(default=None, ge=MIN_REPETITION_PENALTY,
                                                   le=MAX_REPETITION_PENALTY, allow_inf_nan=False,
                                                   description="in [0.01, 100]; 1 or null: off (vLLM's)")
    min_tokens: json_int(ge=0) | None = Field(default=None, description="at most max_tokens (vLLM's)")
    best_of: Unsupported = None
    suffix: Unsupported = None
    user: str | None = Field(default=None, description="an end-user id: accepted, asks for no behaviour")

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v):
        """One message naming the bad entry (param `logit_bias`), not pydantic's per-key errors."""
        if v is None:
            return None
        if not isinstance(v, dict):
            raise ValueError("must be an object mapping token ids (as strings) to a bias in [-100, 100]")
        out = {}
        for key, bias in v.items():
            if not (isinstance(key, str) and re.fullmatch(TOKEN_ID_KEY, key)):
                raise ValueError(f"key {key!r} is not a token id: keys are token ids in decimal digits such as "
                                 f"\"50256\"")
            if type(bias) not in (int, float) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails too
                raise ValueError(f"{key}: {bias!r} is not a bias: send a number in [-100, 100]")
            out[int(key)] = float(bias)
        return out


MAX_PROMPTS = 256  # choices in one /v1/completions request: prompts x n (each is a request of the engine's queue)
MAX_N = 16  # choices per prompt
PromptText = Annotated[str, StringConstraints(min_length=1)]
PromptIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(CommonFields):
    prompt: PromptText | PromptIds | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)] | \
        Annotated[list[PromptIds], Field(min_length=1, max_length=MAX_PROMPTS)] = Field(
            description="a string, a list of token ids, or a list of either (one choice per prompt, in order)")
    logprobs: json_int(ge=0, le=5) | None = Field(default=None, description="logprobs of each token and of the "
                                       "k most likely (0-5)")
    echo: bool = Field(default=False, description="the prompt (and its logprobs) before the completion")
    top_logprobs: Unsupported = None  # chat's field: here `logprobs` is the count
    n: json_int(ge=1, le=MAX_N) = Field(default=1, description="choices per prompt (with a seed, choice i samples "
                                        "with seed + i, as vLLM)")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, v):
        """OpenAI's four shapes: "text", [ids], ["text", ...], [[ids], ...]; anything else names what is wrong."""
        shapes = ('send a non-empty string, a non-empty list of token ids, or a list of up to '
                  f'{MAX_PROMPTS} of either (["a", "b"] or [[1, 2], [3]])')
        if isinstance(v, str):
            if v:
                return v
            raise ValueError(f"the prompt is empty: {shapes}")
        if not isinstance(v, list) or not v:
            raise ValueError(f"must be a prompt or a list of prompts: {shapes}")
        if all(isinstance(t, list) for t in v):
            v = [[_json_int(t) for t in ids] for ids in v]
            bad = next((i for i, ids in enumerate(v) if not ids or not all(type(t) is int for t in ids)), None)
            if bad is not None:
                raise ValueError(f"prompt[{bad}] is not a non-empty list of token ids (ints): {shapes}")
        elif all(isinstance(t, str) for t in v):
            bad = next((i for i, text in enumerate(v) if not text), None)
            if bad is not None:
                raise ValueError(f"prompt[{bad}] is empty: {shapes}")
        else:
            v = [_json_int(t) for t in v]
            if not all(type(t) is int for t in v):
                raise ValueError(f"mixes kinds of prompt: {shapes}")
        if isinstance(v[0], (str, list)) and len(v) > MAX_PROMPTS:
            raise ValueError(f"has {len(v)} prompts; this server takes at most {MAX_PROMPTS} in one request")
        return v

    @field_validator("prompt")
    @classmethod
    def _choices_bounded(cls, v, info: ValidationInfo):
        count, n = (len(v) if isinstance(v, list) and isinstance(v[0], (str, list)) else 1), info.data.get("n", 1)
        if count * n > MAX_PROMPTS:
            raise ValueError(f"n={n} choices for each of {count} prompts is more than this server's {MAX_PROMPTS} "
                             f"choices per request; send fewer prompts or a smaller n")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts this request carries, in order (one for a string or a list of token ids)."""
        p = self.prompt
        return list(p) if isinstance(p, list) and isinstance(p[0], (str, list)) else [p]


class ChatRequest(CommonFields):
    messages: list[ChatMessage] = Field(min_length=1, description="system, developer, user, assistant (content "
                                        "null with tool_calls) and tool (with tool_call_id) messages; content a "
                                        "string or a list of text parts")
    max_completion_tokens: json_int(ge=1) | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: json_int(ge=0, le=20) | None = Field(default=None, description="needs logprobs: true")
    echo: Unsupported = None  # a completions field
    # OpenAI's legacy function calling and its hosted features: refused unless their value asks for nothing
    functions: Unsupported = None
    function_call: Unsupported = None
    modalities: Unsupported = None
    audio: Unsupported = None
    prediction: Unsupported = None
    web_search_options: Unsupported = None
    service_tier: Unsupported = None
    reasoning_effort: Unsupported = None
    store: Unsupported = None
    verbosity: Unsupported = None
    moderation: Unsupported = None
    prompt_cache_options: Unsupported = None
    prompt_cache_retention: Unsupported = None
    # identifiers that ask for no behaviour: accepted and not used (the prefix cache serves every request)
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v, info: ValidationInfo):
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v
