"""A Llama-family decoder in plain PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU, tied embeddings.

Module and parameter names mirror Hugging Face's `LlamaForCausalLM`, so an HF safetensors file loads as is.

Attention is the one place where serving systems differ, so it is a parameter: every layer hands its
(q, k, v) to an `attention` callable. The default is dense causal attention over the tokens passed in,
which is all a learner needs (`logits = model(input_ids)`). The engine passes its own callable that
writes K/V into a (paged) cache and attends over it, so the model stays as plain as a textbook's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int | None = None
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        names = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in d.items() if k in names}
        # transformers >= 5 may nest rope settings under rope_parameters
        rp = d.get("rope_parameters")
        if isinstance(rp, dict):
            kwargs.setdefault("rope_theta", rp.get("rope_theta", 10000.0))
            if rp.get("rope_type", "default") != "default":
                kwargs.setdefault("rope_scaling", rp)
        return cls(**kwargs, extra={k: v for k, v in d.items() if k not in names})

    def num_parameters(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return L * per_layer + emb + h


class AttentionFn(Protocol):
    """What a layer calls: q [B, T, Hq, D], k/v [B, T, Hkv, D] -> out [B, T, Hq, D]."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def dense_causal_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over exactly the tokens given (no cache). GQA: each KV head serves Hq/Hkv query heads."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return out.transpose(1, 2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 for stability, as the reference implementation does
        # (F.rms_norm is the same formula, x * rsqrt(mean(x^2) + eps), in one kernel instead of five)
        dtype = x.dtype
        x = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings, with Llama-3 style or linear scaling when the config asks."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind not in ("default", None):
        raise ValueError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")
    return inv_freq.float()


class RopeFn(Protocol):
    """A RoPE implementation: x [B, T, H, D], positions [B, T] -> x rotated (lab 00's exercise)."""

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor: ...


def _rotating(attention: AttentionFn, rope: RopeFn, positions: torch.Tensor, theta: float) -> AttentionFn:
    """`attention` whose q and k are first rotated by `rope` at `positions`."""

    def call(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(layer_idx, rope(q, positions, theta), rope(k, positions, theta), v)

    return call


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; cos/sin [B, T, D]. Rotates pairs (i, i + D/2) by position-dependent angles."""
    return x * cos.unsqueeze(2) + rotate_half(x) * sin.unsqueeze(2)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)


class LlamaForCausalLM(nn.Module):
    """`model(input_ids)` -> logits. `hidden_states(ids, positions, attention)` is the engine's entry point."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # read from the embedding: it stays a float tensor when the linears (lm head included) are quantized
    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention: AttentionFn = dense_causal_attention,
        rope: RopeFn | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> final hidden states [B, T, H] (after the last norm).

        `rope(x, positions, theta)`, when given, rotates every layer's q and k instead of the built-in tables
        (lab 00 runs a learner's RoPE this way); it supports no `rope_scaling`."""
        positions = self.checked_positions(input_ids, positions)
        x = self.model.embed_tokens(input_ids)
        if rope is None:
            cos, sin = self.model.rotary_emb(positions, x.dtype)
        else:
            if self.config.rope_scaling:
                raise ValueError("a replacement rope(x, positions, theta) cannot apply this model's rope_scaling; "
                                 "use a model without rope scaling (SmolLM2 has none)")
            # the built-in rotation becomes the identity (cos 1, sin 0 leave q and k unchanged, bit for bit) and
            # `rope` rotates q and k on their way into attention
            cos = torch.ones(*positions.shape, self.config.head_dim, dtype=x.dtype, device=x.device)
            sin = torch.zeros_like(cos)
            attention = _rotating(attention, rope, positions, self.config.rope_theta)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attention)
        return self.model.norm(x)

    def checked_positions(self, input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """The positions of `input_ids` [B, T]: 0..T-1 unless given; a clear error for a bad shape or length."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if positions is None:
            if input_ids.shape[1] > self.config.max_position_embeddings:
                raise ValueError(
                    f"sequence of {input_ids.shape[1]} tokens is longer than the model's context of "
                    f"{self.config.max_position_embeddings} tokens; shorten the prompt"
                )
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        # callers that pass positions (the engine, the KV caches) bound them already: no host sync per forward
        return positions

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention: AttentionFn = dense_causal_attention,
        rope: RopeFn | None = None,
    ) -> torch.Tensor:
        """[B, T] int64 -> [B, T, vocab] logits."""
        if rope is None:  # subclasses (the engine's fused CPU layers) take no rope
            return self.logits(self.hidden_states(input_ids, positions, attention))
        return self.logits(self.hidden_states(input_ids, positions, attention, rope=rope))
