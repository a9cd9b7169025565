"""Tensor parallelism (Megatron-LM style) of the lab's Llama, in place, for one rank of `world_size`.

Each layer is split so that only two all-reduces per layer are needed:
- attention: q/k/v are *column*-parallel (each rank computes its own heads: KV heads are split across ranks,
  each with the query heads that share it), o_proj is *row*-parallel (each rank multiplies its heads' slice of
  the input and the partial outputs are summed with one all-reduce);
- MLP: gate/up column-parallel (a slice of the intermediate units), down row-parallel + one all-reduce.
Embedding, norms and lm_head stay replicated (every rank ends a step with the same logits and the same greedy
token, so no extra broadcast is needed).

SmolLM2 has 3 KV heads: with 2 ranks they split 2 + 1 (uneven but exact). vLLM instead requires divisibility or
replicates KV heads; an uneven split keeps the maths identical at the cost of load balance.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lab_utils.parallel.comm import Comm


def split_sizes(n: int, parts: int) -> list[int]:
    """n items over `parts` ranks, the first ranks taking one more when it does not divide: 3 over 2 -> [2, 1]."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def shard_range(n: int, parts: int, rank: int) -> tuple[int, int]:
    sizes = split_sizes(n, parts)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def column_shard(linear: nn.Linear, start: int, end: int) -> nn.Linear:
    """Keep output features [start, end): this rank computes those outputs from the full (replicated) input."""
    out = nn.Linear(linear.in_features, end - start, bias=False, device=linear.weight.device, dtype=linear.weight.dtype)
    out.weight.data.copy_(linear.weight.data[start:end])
    return out


class RowParallelLinear(nn.Module):
    """Keep input features [start, end): a partial product; the all-reduce sums the ranks' parts into y = xW^T."""

    def __init__(self, linear: nn.Linear, start: int, end: int, comm: Comm) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.data[:, start:end].clone(), requires_grad=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(F.linear(x, self.weight))


def shard_llama(model: nn.Module, comm: Comm) -> nn.Module:
    """Turn a full `LlamaForCausalLM` into this rank's tensor-parallel shard (in place; returns it)."""
    cfg, rank, world = model.config, comm.rank, comm.world_size
    if cfg.num_key_value_heads < world:
        raise ValueError(
            f"world_size={world} is larger than num_key_value_heads={cfg.num_key_value_heads}: every rank needs at "
            f"least one KV head; use world_size <= {cfg.num_key_value_heads}"
        )
    group = cfg.num_attention_heads // cfg.num_key_value_heads  # query heads per KV head
    D = cfg.head_dim
    kv0, kv1 = shard_range(cfg.num_key_value_heads, world, rank)
    i0, i1 = shard_range(cfg.intermediate_size, world, rank)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = column_shard(attn.q_proj, kv0 * group * D, kv1 * group * D)
        attn.k_proj = column_shard(attn.k_proj, kv0 * D, kv1 * D)
        attn.v_proj = column_shard(attn.v_proj, kv0 * D, kv1 * D)
        attn.o_proj = RowParallelLinear(attn.o_proj, kv0 * group * D, kv1 * group * D, comm)
        attn.num_heads, attn.num_kv_heads = (kv1 - kv0) * group, kv1 - kv0
        mlp.gate_proj = column_shard(mlp.gate_proj, i0, i1)
        mlp.up_proj = column_shard(mlp.up_proj, i0, i1)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, i0, i1, comm)
    model.local_kv_heads = kv1 - kv0
    return model
