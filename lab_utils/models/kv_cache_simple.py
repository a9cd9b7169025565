"""The simplest KV cache: one contiguous [batch, max_len, kv_heads, head_dim] buffer per layer.

Lab 00's cache. It is the model's `attention` callable: each layer hands it this step's (q, k, v); it writes
k/v after the tokens already cached and attends over everything so far. New tokens see all cached tokens and,
among themselves, only earlier ones (causal with an offset), so a prefill and a one-token decode step are the
same code. Every sequence in the batch has the same length here; ragged batches and paging come in later labs.

    cache = SimpleKVCache.for_model(model, batch=2, max_len=64)
    logits = cache.forward(model, prompt_ids)      # prefill: writes positions 0..T-1
    logits = cache.forward(model, next_ids)        # decode: writes position T, attends over T+1 keys
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class SimpleKVCache:
    def __init__(
        self,
        num_layers: int,
        batch: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if batch < 1 or max_len < 1:
            raise ValueError(f"batch={batch} and max_len={max_len} must both be >= 1")
        shape = (batch, max_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.batch, self.max_len = batch, max_len
        self.length = 0  # tokens cached per sequence (committed by `advance`)

    @classmethod
    def for_model(cls, model, batch: int, max_len: int) -> SimpleKVCache:
        c = model.config
        if max_len > c.max_position_embeddings:
            raise ValueError(
                f"max_len={max_len} is longer than the model's context of {c.max_position_embeddings} tokens"
            )
        return cls(c.num_hidden_layers, batch, max_len, c.num_key_value_heads, c.head_dim, model.dtype, model.device)

    def nbytes(self) -> int:
        """Memory the cache holds (allocated up front for max_len tokens, used or not)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, T = q.shape[:2]
        start, end = self.length, self.length + T
        if B != self.batch:
            raise ValueError(f"batch of {B} sequences but the cache was made for batch={self.batch}")
        if end > self.max_len:
            raise ValueError(f"{end} tokens do not fit a cache of max_len={self.max_len} (cached {start}, new {T})")
        self.k[layer_idx][:, start:end] = k
        self.v[layer_idx][:, start:end] = v
        keys, values = self.k[layer_idx][:, :end], self.v[layer_idx][:, :end]
        mask = None
        if T > 1:  # new token i sits at position start+i: it may see keys 0..start+i
            mask = torch.ones(T, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )
        return out.transpose(1, 2)

    def positions(self, num_new: int) -> torch.Tensor:
        """Positions of the next `num_new` tokens of every sequence: [batch, num_new]."""
        device = self.k[0].device
        return torch.arange(self.length, self.length + num_new, device=device).expand(self.batch, num_new)

    def advance(self, num_new: int) -> None:
        """Commit the tokens the last forward pass wrote (every layer has written them by now)."""
        self.length += num_new

    @torch.no_grad()
    def forward(self, model, input_ids: torch.Tensor) -> torch.Tensor:
        """Run the new tokens through `model` with this cache; returns their logits [B, T, vocab]."""
        T = input_ids.shape[1]
        logits = model(input_ids, self.positions(T), attention=self)
        self.advance(T)
        return logits
