"""Is a proposer's acceptance in the engine what its accuracy outside the engine predicts? A bug check.

A head that scores well offline but poorly in the engine points to a bug (features of the wrong position,
layer or dtype; a token off by one); a head that scores poorly in both simply has not learned enough. So:

- `ProposalRecorder` wraps the engine's proposer and records every call: the request's tokens, the target
  hidden rows it was handed, and the guesses it made.
- `replay` recomputes every recorded proposal OUTSIDE the engine, teacher-forced: one plain forward of the
  target over the final text gives the features (the training-time path: `model.hidden_states`, final norm,
  the model's dtype), and a fresh proposer (no per-request history) gets the rows the engine's history would
  hold. The guesses must be the same; so must the acceptance they imply (`accepted_from_text`).
- `teacher_forced` scores a proposer at EVERY generated position of a text (top-1 per draft depth, and the
  chain acceptance), the figure the training scripts report on held-out text.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Call:
    request_id: str | None
    token_ids: list[int]              # the request's tokens when the proposer was asked
    hidden: torch.Tensor | None       # the target rows the engine handed over (None for draft / n-gram)
    guesses: list[int]


class ProposalRecorder:
    """Wrap `engine.spec.proposer.propose` (in place) and keep every call, until `stop()`."""

    def __init__(self, engine) -> None:
        if engine.spec is None:
            raise ValueError("the engine has no speculative decoding configured (EngineConfig(speculative=...))")
        self.proposer = engine.spec.proposer
        self.calls: list[Call] = []
        inner = self.proposer.propose

        def propose(token_ids, k, hidden=None, temperature=0.0):
            prop = inner(token_ids, k, hidden=hidden, temperature=temperature)
            h = None if hidden is None else hidden.detach().clone()
            self.calls.append(Call(self.proposer.request_id, list(token_ids), h, list(prop.token_ids)))
            return prop

        self.proposer.propose = propose

    def stop(self) -> None:
        """Unwrap the proposer (calls made after this are not recorded)."""
        self.proposer.__dict__.pop("propose", None)


def accepted_from_text(calls: list[Call], texts: dict[str, list[int]]) -> list[int]:
    """Guesses kept per call, read from the final text of its request (greedy: the longest agreeing prefix)."""
    out = []
    for c in calls:
        final, L, n = texts[c.request_id], len(c.token_ids), 0
        while n < len(c.guesses) and L + n < len(final) and final[L + n] == c.guesses[n]:
            n += 1
        out.append(n)
    return out


def history_rows(proposer, prompt_len: int, L: int) -> tuple[int, int]:
    """(a, b): the target rows [a, b) an engine request holds when it asks at length L. After the prefill the
    engine hands over the last prompt row (position prompt_len - 1), then every verified row; EAGLE keeps its
    last `window` rows, Medusa uses only the newest."""
    window = getattr(getattr(proposer, "head", None), "window", 1)
    return max(prompt_len - 1, L - 1 - window), L - 1


@torch.no_grad()
def replay(proposer, model, calls: list[Call], prompts: dict[str, list[int]], texts: dict[str, list[int]]):
    """For each call: (engine guesses, offline guesses, max |engine row - offline row|, top-2 logit gap of the
    offline target at the first guess). Offline = teacher-forced from one plain forward over the final text."""
    feats = {rid: model.hidden_states(torch.tensor([ids], device=model.device))[0] for rid, ids in texts.items()}
    saved = getattr(proposer, "request_id", None)
    proposer.request_id = None   # no per-request history: the rows are handed over explicitly
    out = []
    try:
        for c in calls:
            L, H = len(c.token_ids), feats[c.request_id]
            hidden, diff = None, 0.0
            if c.hidden is not None:
                a, b = history_rows(proposer, len(prompts[c.request_id]), L)
                hidden = H[a:b]
                n = c.hidden.shape[0]
                diff = float((c.hidden.float() - H[b - n:b].float()).abs().max())
            prop = proposer.propose(c.token_ids, len(c.guesses), hidden=hidden) if c.guesses else None
            out.append((c.guesses, [] if prop is None else list(prop.token_ids), diff))
    finally:
        proposer.request_id = saved
    return out


@torch.no_grad()
def teacher_forced(proposer, model, ids: list[int], prompt_len: int, k: int) -> torch.Tensor:
    """correct [N, k] bool: at every generated position L (prompt_len <= L <= len(ids) - k), the proposer's k
    guesses from the true text ids[:L] vs the true next tokens ids[L:L+k]."""
    H = model.hidden_states(torch.tensor([ids], device=model.device))[0] if getattr(proposer, "needs_hidden",
                                                                                       False) else None
    proposer.request_id = None
    rows = []
    for L in range(prompt_len + 1, len(ids) - k + 1):
        hidden = None
        if H is not None:
            a, b = history_rows(proposer, prompt_len, L)
            hidden = H[a:b]
        g = proposer.propose(ids[:L], k, hidden=hidden).token_ids
        g = (g + [-1] * k)[:k]
        rows.append([x == y for x, y in zip(g, ids[L:L + k])])
    return torch.tensor(rows, dtype=torch.bool).reshape(-1, k)
