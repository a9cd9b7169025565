"""The request bodies of /v1/completions and /v1/chat/completions, one field per line (so a new field is one line).

Every field is checked here, before the engine sees it: a bad value is a 400 naming the field. OpenAI fields this
server does not implement are refused unless their value asks for nothing (`NOT_IMPLEMENTED`), never silently
ignored.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictFloat, StrictInt, StringConstraints,
                      ValidationInfo, field_validator)

from lab_utils.engine.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_STRINGS, PENALTY_RANGE, SEED_RANGE
from lab_utils.server.messages import ChatMessage
from lab_utils.server.streaming import StreamOptions
from lab_utils.server.tools import NamedToolChoice, ResponseFormat, Tool

StopString = Annotated[str, StringConstraints(min_length=1, max_length=256)]
# OpenAI fields this server does not implement (top_logprobs on /v1/completions, echo on chat: not fields of those
# endpoints), with the values that ask for nothing (accepted); any other value is a 400 naming the field, never
# silently ignored
NOT_IMPLEMENTED = {"best_of": (1,), "suffix": ("",), "top_logprobs": (0,), "echo": (False,)}


def _refuse(v, info: ValidationInfo):
    neutral = NOT_IMPLEMENTED[info.field_name]
    if v is None or (type(v) is not bool or type(neutral[0]) is bool) and v in neutral:
        return None
    raise ValueError(f"{v!r} is not supported by this server; omit {info.field_name} or send "
                     f"{json.dumps(neutral[0])}")


Unsupported = Annotated[Any, BeforeValidator(_refuse)]
Penalty = Annotated[StrictFloat | None, Field(default=None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1],
                                              allow_inf_nan=False, description="in [-2, 2]; 0 or null: off")]


# the fields both endpoints take (a comment, not a docstring: pydantic would put a docstring in the schema)
class CommonFields(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields this server does not use (user, ...)

    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=1, description="capped at the server's --max-tokens-cap")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1, description="0 or -1: off")
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = Field(default=None, description="only with stream: true")
    return_token_ids: bool = Field(default=False, description="vLLM's: each choice carries its token ids (each "
                                                              "chunk the new ones), and the prompt's are returned")
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=1, description="one choice per request")
    response_format: ResponseFormat | None = None  # {"type": "json_object"} | {"type": "json_schema", ...}
    # the sampler's logit processors (vLLM's definitions; docs/SERVER.md)
    logit_bias: dict[int, float] | None = Field(default=None, description="token id (a string) -> bias in [-100, 100]")
    frequency_penalty: Penalty
    presence_penalty: Penalty
    repetition_penalty: StrictFloat | None = Field(default=None, gt=0.0, allow_inf_nan=False,
                                                   description="> 0; 1 or null: off (vLLM's)")
    min_tokens: StrictInt | None = Field(default=None, ge=0, description="at most max_tokens (vLLM's)")
    best_of: Unsupported = None
    suffix: Unsupported = None

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
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"key {key!r} is not a token id: keys are token ids such as \"50256\"") from None
            if token < 0:
                raise ValueError(f"key {key!r} is not a token id: token ids are >= 0")
            if type(bias) not in (int, float) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails too
                raise ValueError(f"{key}: {bias!r} is not a bias: send a number in [-100, 100]")
            out[token] = float(bias)
        return out


class CompletionRequest(CommonFields):
    prompt: Annotated[str, StringConstraints(min_length=1)] | Annotated[list[int], Field(min_length=1)]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5, description="logprobs of each token and of the "
                                       "k most likely (0-5)")
    echo: bool = Field(default=False, description="the prompt (and its logprobs) before the completion")
    top_logprobs: Unsupported = None  # chat's field: here `logprobs` is the count

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        if (isinstance(v, str) and v) or (isinstance(v, list) and v and all(type(t) is int for t in v)):
            return v
        raise ValueError("must be a non-empty string or a non-empty list of token ids (ints); one prompt per request")


class ChatRequest(CommonFields):
    messages: list[ChatMessage] = Field(min_length=1, description="system, developer, user, assistant (content "
                                        "null with tool_calls) and tool (with tool_call_id) messages; content a "
                                        "string or a list of text parts")
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20, description="needs logprobs: true")
    echo: Unsupported = None  # a completions field

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v, info: ValidationInfo):
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v
