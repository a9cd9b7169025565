"""Prompt lookup (n-gram) proposals: no model at all. If the last n tokens already occurred earlier in the
sequence, guess that what followed them then follows them now. Free to run, and very good whenever the
output copies from the input (editing code, quoting a passage, summarising with citations)."""
from __future__ import annotations

import torch

from lab_utils.speculative.base import Proposal, Proposer


def prompt_lookup(token_ids: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix
    (n from max_n down to min_n). Empty if no suffix of length >= min_n occurred before."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n:]
        best: list[int] = []
        # scan right to left: the most recent occurrence is the likeliest to continue the same way, but one
        # that overlaps the end has fewer than k followers, so keep looking for a full-length continuation
        for start in range(length - n - 1, -1, -1):
            if token_ids[start:start + n] == suffix:
                follow = token_ids[start + n:start + n + k]
                if len(follow) == k:
                    return follow
                if len(follow) > len(best):
                    best = follow
        if best:
            return best
    return []


class NgramProposer(Proposer):
    def __init__(self, spec_config, target_model=None, device: torch.device | str = "cpu") -> None:
        self.min_n, self.max_n = spec_config.prompt_lookup_min, spec_config.prompt_lookup_max
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"prompt_lookup_min={self.min_n} and prompt_lookup_max={self.max_n} must satisfy "
                             f"1 <= min <= max")

    def propose(self, token_ids: list[int], k: int, hidden: torch.Tensor | None = None,
                temperature: float = 0.0) -> Proposal:
        return Proposal(prompt_lookup(token_ids, k, self.min_n, self.max_n))  # deterministic: q is one-hot
