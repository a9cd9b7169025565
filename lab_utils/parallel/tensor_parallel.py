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


SHARD_PART, ROW_PART = "tensor_parallel.shard_weights", "tensor_parallel.row_parallel"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shard_weights(w: dict[str, torch.Tensor], rank: int, world_size: int, heads_per_kv: int,
                  head_dim: int) -> dict[str, torch.Tensor]:
    """This rank's slice of one layer's seven weights ([out_features, in_features] each, as `nn.Linear` keeps
    them): q/k/v and gate/up keep rows (output features: column-parallel), o and down keep columns (input
    features: row-parallel). KV heads split first ranks first (3 over 2 -> 2 + 1), each with its query heads."""
    kv0, kv1 = shard_range(w["k_proj"].shape[0] // head_dim, world_size, rank)
    i0, i1 = shard_range(w["gate_proj"].shape[0], world_size, rank)
    q0, q1 = kv0 * heads_per_kv * head_dim, kv1 * heads_per_kv * head_dim
    k0, k1 = kv0 * head_dim, kv1 * head_dim
    return {"q_proj": w["q_proj"][q0:q1], "k_proj": w["k_proj"][k0:k1], "v_proj": w["v_proj"][k0:k1],
            "o_proj": w["o_proj"][:, q0:q1], "gate_proj": w["gate_proj"][i0:i1], "up_proj": w["up_proj"][i0:i1],
            "down_proj": w["down_proj"][:, i0:i1]}


def row_parallel(x: torch.Tensor, weight: torch.Tensor, all_reduce) -> torch.Tensor:
    """A row-parallel linear: this rank's partial product x_r W_r^T, summed over ranks by `all_reduce` (in place,
    returns its argument) into the full y = x W^T."""
    return all_reduce(F.linear(x, weight))


def _column_linear(weight: torch.Tensor) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    out.weight.data.copy_(weight)
    return out


class RowParallelLinear(nn.Module):
    """Keep input features [start, end) of the weight: a partial product; `row_fn` (default `row_parallel`)
    multiplies and all-reduces it into y = xW^T."""

    def __init__(self, weight: torch.Tensor, comm: Comm, row_fn=row_parallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().contiguous().clone(), requires_grad=False)
        self.comm, self.row_fn = comm, row_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.row_fn(x, self.weight, self.comm.all_reduce)


def _check_shards(s: dict, full: dict, group: int, D: int) -> None:
    """The shapes a rank's shard must have to run at all; a wrong split says so here, not inside attention."""
    from lab_utils.course.parts import LearnerPartError

    missing = [k for k in LINEARS if not isinstance(s.get(k), torch.Tensor)]
    if missing:
        raise LearnerPartError(f"your {SHARD_PART} returned no tensor for {missing}: return all seven weights")
    kv = s["k_proj"].shape[0] / D
    want = {"q_proj": (kv * group * D, full["q_proj"].shape[1]), "k_proj": (kv * D, full["k_proj"].shape[1]),
            "v_proj": (kv * D, full["v_proj"].shape[1]), "o_proj": (full["o_proj"].shape[0], kv * group * D),
            "up_proj": tuple(s["gate_proj"].shape), "down_proj": (full["down_proj"].shape[0], s["gate_proj"].shape[0])}
    for k, shape in want.items():
        if tuple(s[k].shape) != shape or kv != int(kv) or kv < 1:
            raise LearnerPartError(f"your {SHARD_PART} returned {k} of shape {tuple(s[k].shape)}; with k_proj "
                                   f"{tuple(s['k_proj'].shape)} and gate_proj {tuple(s['gate_proj'].shape)} it must be "
                                   f"{shape} (whole KV heads; q/k/v/gate/up keep rows, o/down keep columns)")


def load_tp_parts(names=()) -> tuple:
    """(shard_fn, row_fn, names used): the learner's saved versions of the parts in `names` (from my_engine/,
    `LAB_LEARNER_DIR`; these run in rank processes that cannot see the notebook), the reference elsewhere."""
    from lab_utils.course import learner_parts

    fns, mine = learner_parts.saved_parts(names, {SHARD_PART: shard_weights, ROW_PART: row_parallel}, "tensor-parallel")
    return fns[SHARD_PART], fns[ROW_PART], mine


def shard_llama(model: nn.Module, comm: Comm, shard_fn=shard_weights, row_fn=row_parallel) -> nn.Module:
    """Turn a full `LlamaForCausalLM` into this rank's tensor-parallel shard (in place; returns it). `shard_fn`
    slices each layer's weights (`shard_weights`), `row_fn` is o_proj's and down_proj's forward (`row_parallel`)."""
    cfg, rank, world = model.config, comm.rank, comm.world_size
    if cfg.num_key_value_heads < world:
        raise ValueError(
            f"world_size={world} is larger than num_key_value_heads={cfg.num_key_value_heads}: every rank needs at "
            f"least one KV head; use world_size <= {cfg.num_key_value_heads}"
        )
    group = cfg.num_attention_heads // cfg.num_key_value_heads  # query heads per KV head
    D = cfg.head_dim
    local_kv = None
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        full = {k: getattr(attn if k in LINEARS[:4] else mlp, k).weight.data for k in LINEARS}
        s = shard_fn(dict(full), rank, world, group, D)
        _check_shards(s if isinstance(s, dict) else {}, full, group, D)
        kv = s["k_proj"].shape[0] // D
        attn.q_proj, attn.k_proj, attn.v_proj = (_column_linear(s[k]) for k in ("q_proj", "k_proj", "v_proj"))
        attn.o_proj = RowParallelLinear(s["o_proj"], comm, row_fn)
        attn.num_heads, attn.num_kv_heads = kv * group, kv
        mlp.gate_proj, mlp.up_proj = _column_linear(s["gate_proj"]), _column_linear(s["up_proj"])
        mlp.down_proj = RowParallelLinear(s["down_proj"], comm, row_fn)
        local_kv = kv
    model.local_kv_heads = local_kv
    return model
