"""The proposer interface of speculative decoding: something cheap guesses the next k tokens, the target
model checks all k in one forward pass (see `verify.py`), and the engine keeps the longest agreeing prefix.

Every method (a draft model, n-gram prompt lookup, Medusa heads, an EAGLE feature-level head) implements
`Proposer`. The engine calls `propose()` once per request per step, right before the verify forward.

The `hidden` contract (for `needs_hidden = True` proposers: Medusa, EAGLE)
-------------------------------------------------------------------------
`hidden` is a float tensor [n, H] (n >= 1) of the TARGET model's final-norm hidden states (the input of
`model.logits`), on the engine's device, in the model's dtype. Row j is the hidden state at position
`p_j = len(token_ids) - 1 - n + j`, i.e. the state from which the target predicted `token_ids[p_j + 1]`.
So the LAST row, `hidden[-1]`, is the state that produced the last token `token_ids[-1]` (the newest token,
which the target has not computed yet): Medusa head i applied to `hidden[-1]` guesses `token_ids[-1 + i + 1]`,
the i-th proposal; EAGLE feeds (`hidden[-1]`, embedding of `token_ids[-1]`) to predict the next feature.
After a prefill n == 1; after a verify step n == num_accepted + 1 (the accepted proposals' rows plus the row
that produced the correction/bonus token), so a head that keeps its own per-request state can append them.
Proposers that do not set `needs_hidden` get `hidden=None`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    token_ids: list[int]                 # k proposed tokens (may be fewer, even 0)
    probs: torch.Tensor | None = None    # [len(token_ids), vocab] draft distribution q; None = deterministic (one-hot)


class Proposer(ABC):
    """Guesses the continuation of one request. `propose` must not change the request; per-request state
    (a draft KV cache, ...) is keyed by request id and kept in step through `on_accept` / `release`."""

    needs_hidden: bool = False           # True: propose() gets the target's final hidden state(s), see above
    # the engine sets this to the id of the request being served right before each propose() call, so a
    # stateful proposer (the draft model's KV cache) can keep per-request state without a wider signature
    request_id: str | None = None
    # proposers that set `shares_target_kv` (a draft that *is* the target, e.g. quantized) also get, before each
    # propose(), `target_kv = (n, read)`: the target's cache holds the request's first n tokens, and
    # read(start, end) returns their keys/values [(K, V) per layer, each [end - start, kv_heads, head_dim]]
    shares_target_kv: bool = False
    target_kv: tuple[int, Callable[[int, int], list[tuple[torch.Tensor, torch.Tensor]]]] | None = None

    @abstractmethod
    def propose(self, token_ids: list[int], k: int, hidden: torch.Tensor | None = None,
                temperature: float = 0.0) -> Proposal:
        """Up to `k` guesses for the tokens after `token_ids` (prompt + output so far). With temperature > 0 a
        proposer that samples must return `probs` = the distribution it sampled each guess from (at that
        temperature), so the verifier can keep the output distribution exact; greedy guesses may return None."""

    def on_accept(self, request_id: str, num_accepted: int) -> None:
        """Called after verification: `num_accepted` of the last proposal's tokens were kept."""

    def release(self, request_id: str) -> None:
        """The request ended (finished, aborted, preempted): free any per-request state."""
