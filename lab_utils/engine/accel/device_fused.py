"""The model a GPU engine runs: the same Llama, with fewer and bigger kernels per layer.

A decode step on a GPU is a few hundred tiny kernels; each costs its launch (eagerly) or its place in a CUDA graph,
whatever its size. The reference layer (`models/llama.py`, the one the labs teach) makes ~35 of them per layer:
seven linears, RMSNorm as casts + norm + multiply, RoPE as ten, the residual adds. This view does the same maths
with about half as many dispatcher calls per decode layer:
- q/k/v as one linear and gate/up as one (vLLM's `QKVParallelLinear` / `MergedColumnParallelLinear`; the CPU
  view `cpu_fused` does the same). The caller's q/k/v (gate/up) parameters become views of the one fused weight:
  same values, same Parameter objects, no second copy of the weights on the device;
- RMSNorm as `F.rms_norm` with its weight (one op), the residual add folded into the o/down projections
  (`torch.addmm(x, out, W^T)`: the GEMM adds it);
- RoPE over q, k and v at once, as `x*cos + roll(x, D/2)*sin_signed` with per-step tables that are the identity
  (cos 1, sin 0) on the v heads, so one `addcmul` rotates the step's q and k and leaves v as it is;
- an attention callable that `takes_token_major` gets q/k/v as [N, H, 1, D] (each token its own SDPA batch row:
  a decode step's layout, no reshape in the layer; its `token_major` is set to say so); any other gets the
  protocol's [1, N, H, D];
- an attention callable with `prepare()` builds its per-step metadata before the first layer.

Built for CUDA engines (`cpu_view.fast_linears`) and by `bench.step_counts.cuda_logic_engine` (CUDA's code path on a
CPU); CPU engines keep the CPU view. Same results as the reference model to round-off (tests/unit/test_step_counts.py).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from lab_utils.models.llama import (
    AttentionFn,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    dense_causal_attention,
)

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def device_fusable(model: nn.Module) -> bool:
    """A plain Llama whose seven projections per layer are bias-free `nn.Linear`s of one floating dtype: subclasses
    may change the maths, and quantized or sharded projections keep their own forward."""
    if type(model) is not LlamaForCausalLM or not model.dtype.is_floating_point:
        return False
    for layer in model.model.layers:
        if type(layer) is not LlamaDecoderLayer:
            return False
        for name in _ATTENTION + _MLP:
            lin = getattr(layer.self_attn if name in _ATTENTION else layer.mlp, name)
            if type(lin) is not nn.Linear or lin.bias is not None or lin.weight.dtype != model.dtype:
                return False
    return True


def _share_one_weight(linears: list[nn.Linear]) -> torch.Tensor:
    """One weight [sum(out), in] holding the linears' weights side by side; each linear's weight becomes a view of
    it (same values and Parameter objects, one copy in memory)."""
    with torch.no_grad():
        fused = torch.cat([lin.weight.detach() for lin in linears])
        start = 0
        for lin in linears:
            n = lin.weight.shape[0]
            lin.weight.data = fused[start:start + n]
            start += n
    return fused


class DeviceFusedLayer(LlamaDecoderLayer):
    """A `LlamaDecoderLayer` (same parameters) whose residual stream is [N, H]; set up by `fuse`."""

    def fuse(self) -> None:
        a, m = self.self_attn, self.mlp
        self.qkv_weight = _share_one_weight([a.q_proj, a.k_proj, a.v_proj])
        self.gate_up_weight = _share_one_weight([m.gate_proj, m.up_proj])
        self.o_weight_t, self.down_weight_t = a.o_proj.weight.detach().t(), m.down_proj.weight.detach().t()
        self.heads = (a.num_heads, a.num_kv_heads, a.num_kv_heads)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, attention: AttentionFn,
                token_major: bool = False) -> torch.Tensor:
        """x [N, H] -> x [N, H]; cos / sin_signed: the step's RoPE tables in the layout q/k/v take here."""
        n, d = x.shape[0], self.self_attn.head_dim
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        h = F.rms_norm(x, x.shape[-1:], ln1.weight, ln1.eps)
        shape = (n, sum(self.heads), 1, d) if token_major else (1, n, sum(self.heads), d)
        qkv = F.linear(h, self.qkv_weight).view(shape)
        qkv = torch.addcmul(qkv * cos, qkv.roll(d // 2, -1), sin_signed)  # RoPE on q and k; v: x*1 + 0
        q, k, v = qkv.split(self.heads, dim=1 if token_major else 2)
        out = attention(self.self_attn.layer_idx, q, k, v)
        out = out.view(n, -1) if token_major else out.reshape(n, -1)  # [N, Hq, 1, D] (SDPA's) is contiguous
        x = torch.addmm(x, out, self.o_weight_t)
        h = F.rms_norm(x, x.shape[-1:], ln2.weight, ln2.eps)
        gate, up = F.linear(h, self.gate_up_weight).chunk(2, dim=-1)
        return torch.addmm(x, F.silu(gate).mul_(up), self.down_weight_t)


class DeviceFusedLlama(LlamaForCausalLM):
    """The reference model's `hidden_states` over `DeviceFusedLayer`s, with the RoPE tables built once per call."""

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      attention: AttentionFn = dense_causal_attention) -> torch.Tensor:
        positions = self.checked_positions(input_ids, positions)
        b, t = input_ids.shape
        if b != 1:  # the engine's steps are one flat row; a batch of rows runs the reference layers
            x = self.model.embed_tokens(input_ids)
            cos, sin = self.model.rotary_emb(positions, x.dtype)
            for layer in self.model.layers:
                x = LlamaDecoderLayer.forward(layer, x, cos, sin, attention)
            return self.model.norm(x)
        prepare = getattr(attention, "prepare", None)
        if prepare is not None:
            prepare()
        token_major = bool(getattr(attention, "takes_token_major", False))
        if token_major:
            attention.token_major = True  # what its layers pass
        x = self.model.embed_tokens(input_ids).view(t, -1)
        cos, sin_signed = self.rope_tables(positions.view(t), x.dtype, token_major)
        for layer in self.model.layers:
            x = layer(x, cos, sin_signed, attention, token_major)
        return F.rms_norm(x, x.shape[-1:], self.model.norm.weight, self.model.norm.eps).view(1, t, -1)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype, token_major: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin_signed (rotate_half's sign folded in) for every q/k/v head of every token: [1, N, H, D], or
        [N, H, 1, D] token-major; the identity (1, 0) on the v heads."""
        cos, sin = self.model.rotary_emb(positions, dtype)  # [N, D]
        heads = self.model.layers[0].heads
        hqk, hv, n, d = heads[0] + heads[1], heads[2], cos.shape[0], cos.shape[-1]
        sin_signed = torch.cat((-sin[:, :d // 2], sin[:, d // 2:]), dim=-1)
        cos = torch.cat((cos[:, None].expand(n, hqk, d), cos.new_ones(n, hv, d)), dim=1)
        sin_signed = torch.cat((sin_signed[:, None].expand(n, hqk, d), sin.new_zeros(n, hv, d)), dim=1)
        shape = (n, hqk + hv, 1, d) if token_major else (1, n, hqk + hv, d)
        return cos.view(shape), sin_signed.view(shape)


def fuse_for_device(model: nn.Module) -> nn.Module:
    """A view of `model` (its parameters shared) with `DeviceFusedLayer`s, or `model` itself where it is not
    `device_fusable`. The model's q/k/v and gate/up weights become views of the fused ones (values unchanged)."""
    if not device_fusable(model):
        return model
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    view = copy.deepcopy(model, memo)
    for layer in view.model.layers:
        layer.__class__ = DeviceFusedLayer
        layer.fuse()
    view.__class__ = DeviceFusedLlama
    return view
