"""Step hooks: how a feature joins every engine step without the step naming it.

`LLMEngine.step` reads schedule -> plan -> run the model -> mask -> pick tokens -> commit -> emit. A feature
that changes what a step computes or which tokens it may pick implements some of the `StepHook` methods below;
the engine calls every hook at each point, in the order they were registered. Speculative decoding
(`lab_utils.speculative.hook`) plans guesses and picks tokens by verifying them; structured output
(`lab_utils.structured.hook`) masks logits, cuts guesses its grammar refuses and ends requests whose grammar
is complete. A new feature is one more hook: `engine.hooks.append(hook)`, the step is not edited.

The unit of work a step passes along is a `StepBatch`: what the scheduler picked, the guesses planned for it,
how many rows of logits each entry returns, and after the forward the logits and the requests that sample.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lab_utils.engine.request import Request
from lab_utils.engine.sampling_params import SamplingParams


@dataclass
class StepBatch:
    """One step's work, as it moves through the hooks."""
    scheduled: list[tuple[Request, int]]  # (request, tokens computed this step), in the runner's order
    num_padding: int  # static batching: ended members computed as padding
    budget_left: int  # tokens of the step's budget the scheduler left unused (guesses may use them)
    start: float  # when the step began (engine clock)
    guesses: dict[str, Any] = field(default_factory=dict)  # request id -> the proposal verified this step
    rows: list[int] | None = None  # per scheduled entry: rows of logits the runner returns (None: one each)
    logits: torch.Tensor | None = None  # after the forward: one row per sampled position
    to_sample: list[Request] = field(default_factory=list)  # after the forward: the requests that pick tokens
    hidden: torch.Tensor | None = None  # after the forward: the last layer's hidden rows (for heads that read it)
    end: float = 0.0  # when its tokens were appended
    hooks: "Hooks | None" = None

    def sampled_rows(self) -> list[int] | None:
        """Rows of logits per request in `to_sample` (None: one each), for the sampler and the logprobs."""
        if self.rows is None:
            return None
        return [r for (req, _), r in zip(self.scheduled, self.rows) if req in self.to_sample]

    def filter_guesses(self, req: Request, proposal):
        """A planned proposal after every hook had its say (a grammar cuts the guesses it refuses)."""
        return self.hooks.filter_guesses(req, proposal) if self.hooks is not None else proposal


class StepHook:
    """A feature's part in each step. Every method has a do-nothing default; implement the ones you need."""

    def validate(self, params: SamplingParams) -> Any:
        """At `add_request`, before anything is queued: raise ValueError for a request this feature cannot serve;
        return per-request state (e.g. a compiled grammar) or None."""
        return None

    def add(self, request_id: str, state: Any) -> None:
        """The request was queued (not rejected); `state` is what `validate` returned."""

    def plan(self, batch: StepBatch) -> None:
        """Before the forward: change what this step computes (add guesses, set `batch.rows`) or start work
        that overlaps the forward (fill grammar masks)."""

    def filter_guesses(self, req: Request, proposal):
        """Another hook planned `proposal` for `req`: return it, or a shorter one."""
        return proposal

    def mask(self, batch: StepBatch) -> None:
        """After the forward: change `batch.logits` (in place or by reassigning) before tokens are picked."""

    def pick(self, batch: StepBatch) -> list[list[int]] | None:
        """The tokens each request in `batch.to_sample` appends, if this hook decides them (a verify step keeps
        accepted guesses + one); None leaves it to the next hook, and finally to the sampler."""
        return None

    def accept(self, req: Request, token: int) -> str | None:
        """`token` was appended to `req`; a finish reason ends the request now (the engine's own stop checks
        run after the hooks)."""
        return None

    def release(self, request_id: str) -> None:
        """The request ended (finished, aborted): drop what this hook keeps for it."""

    def engine_stats(self) -> dict:
        """Counters for `LLMEngine.stats()`."""
        return {}


class Hooks(list):
    """The engine's hooks, called in order."""

    def validate(self, params: SamplingParams) -> list:
        return [h.validate(params) for h in self]

    def add(self, request_id: str, states: list) -> None:
        for h, state in zip(self, states):
            h.add(request_id, state)

    def plan(self, batch: StepBatch) -> None:
        batch.hooks = self
        for h in self:
            h.plan(batch)

    def filter_guesses(self, req: Request, proposal):
        for h in self:
            proposal = h.filter_guesses(req, proposal)
        return proposal

    def mask(self, batch: StepBatch) -> None:
        for h in self:
            h.mask(batch)

    def pick(self, batch: StepBatch) -> list[list[int]] | None:
        for h in self:
            tokens = h.pick(batch)
            if tokens is not None:
                return tokens
        return None

    def accept(self, req: Request, token: int) -> str | None:
        for h in self:
            reason = h.accept(req, token)
            if reason:
                return reason
        return None

    def release(self, request_id: str) -> None:
        for h in self:
            h.release(request_id)

    def stats(self) -> dict:
        out: dict = {}
        for h in self:
            out.update(h.engine_stats())
        return out
