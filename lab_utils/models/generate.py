"""Greedy generation two ways: re-running the whole sequence every token, and prefill once + cached decode.

Both return [batch, prompt_len + n] token ids (prompt included, as HF's `generate` does) and produce the same
tokens; the cached one does O(1) new tokens of work per step instead of O(length). Prompts in a batch share one
length (lab 00 keeps it simple; ragged batches are the engine's job). `on_token(step, next_ids)` is called as
each token is produced (after the device has finished it), which is where per-token timestamps come from.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from lab_utils.device import synchronize
from lab_utils.models.kv_cache_simple import SimpleKVCache

OnToken = Callable[[int, torch.Tensor], None]


def _check(model, ids: torch.Tensor, n: int) -> None:
    if ids.dim() != 2 or ids.shape[1] < 1:
        raise ValueError(f"ids must be [batch, prompt_len] with prompt_len >= 1, got shape {tuple(ids.shape)}")
    if n < 0:
        raise ValueError(f"n={n} new tokens must be >= 0")
    ctx, total = model.config.max_position_embeddings, ids.shape[1] + n
    if total > ctx:
        raise ValueError(
            f"prompt of {ids.shape[1]} tokens + {n} new tokens = {total} is longer than the model's context "
            f"of {ctx} tokens"
        )


def _emit(step: int, nxt: torch.Tensor, device, on_token: OnToken | None) -> None:
    if on_token is not None:
        synchronize(device)  # a timestamp must mean "this token exists", not "this token was queued"
        on_token(step, nxt)


@torch.no_grad()
def generate_naive(model, ids: torch.Tensor, n: int, on_token: OnToken | None = None) -> torch.Tensor:
    """Greedy, no cache: every step runs the full sequence so far through the model and keeps the last row."""
    _check(model, ids, n)
    seq = ids.to(model.device)
    for step in range(n):
        logits = model(seq)  # [B, T, V]: T rows computed, only the last one used
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
        _emit(step, nxt, seq.device, on_token)
    return seq


@torch.no_grad()
def generate_cached(
    model, ids: torch.Tensor, n: int, on_token: OnToken | None = None, cache: SimpleKVCache | None = None
) -> torch.Tensor:
    """Greedy with a KV cache: one prefill pass over the prompt, then one-token decode steps."""
    _check(model, ids, n)
    ids = ids.to(model.device)
    if n == 0:
        return ids
    B, T = ids.shape
    cache = cache or SimpleKVCache.for_model(model, batch=B, max_len=T + n)
    nxt = cache.forward(model, ids)[:, -1].argmax(-1, keepdim=True)  # prefill -> first new token
    out = [nxt]
    _emit(0, nxt, ids.device, on_token)
    for step in range(1, n):
        nxt = cache.forward(model, nxt)[:, -1].argmax(-1, keepdim=True)  # decode: one token in, one out
        out.append(nxt)
        _emit(step, nxt, ids.device, on_token)
    return torch.cat([ids, *out], dim=1)
