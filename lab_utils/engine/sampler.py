"""From logits to the next token: greedy, temperature, top-k, top-p, each request with its own generator."""
from __future__ import annotations

import torch

from lab_utils.engine.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] -> logits with tokens outside the top-k / the top-p nucleus set to -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token if the tokens ranked above it already reach top_p (the best token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.greedy:
        return int(logits.argmax())
    logits = apply_top_k_top_p(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = logits.softmax(-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, V] -> B token ids. All-greedy batches take one argmax on the device."""
    if all(p.greedy for p in params):
        return logits.argmax(-1).tolist()
    return [sample_one(logits[i], p, g) for i, (p, g) in enumerate(zip(params, generators))]
