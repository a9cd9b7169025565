"""A request's life: waiting -> running (prefill chunks, then decode steps) -> finished | aborted | rejected.

The KV cache holds the first `num_computed_tokens` of `token_ids` (prompt + output so far); each step the
scheduler picks how many of the rest to compute. A decode step is just "compute 1 more token".
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from lab_utils.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV copied to host memory
    FINISHED = "finished"
    ABORTED = "aborted"
    REJECTED = "rejected"

    @property
    def done(self) -> bool:
        return self in (Status.FINISHED, Status.ABORTED, Status.REJECTED)


@dataclass
class RequestMetrics:
    """Timestamps in seconds on one monotonic clock (`lab_utils.device.now`)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per output token
    finish_time: float | None = None
    preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + generated
        self.params = params
        self.status = Status.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "rejected: ..."
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        self.block_table: list[int] = []
        self.block_hashes: list[tuple[int, tuple[int, ...]]] = []  # (chained hash, token ids) of full blocks
        self.swapped_kv = None  # host copy of the KV while swapped out
        self.metrics = RequestMetrics(arrival_time)
        self.generator: torch.Generator | None = None
        # per output token / per prompt token (token 0 has none): a TokenLogprob, kept only if the params ask
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})")


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    new_token_ids: list[int] = field(default_factory=list)  # tokens produced by this step (streaming)
    # if the params ask (lab_utils.engine.logprobs.TokenLogprob): the new tokens', every output token's (once
    # finished), the prompt's (with the first token and once finished; entry 0 is None)
    new_logprobs: list | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None
