"""CPU fast path for the whole layer stack: fewer, bigger kernels per layer.

After `cpu_linear` packs the weights, a small-batch decode step on a CPU is still ~30% small-tensor work: per
layer two RMSNorms (each five kernels on a CPU), RoPE on q and on k (five kernels each), three linears that
read the same input (q, k, v) and two more (gate, up), and ~10 module calls. Every kernel costs a few
microseconds of dispatch and an OpenMP fork/join whatever its size, and at batch 1-16 there are ~40 of them
per layer. This view does the same maths with ~15 per layer:

- q, k and v are one packed linear (their weights concatenated once), as are gate and up (vLLM's
  `QKVParallelLinear` and `MergedColumnParallelLinear` do the same, for the same reason);
- RoPE rotates q and k together, as one `addcmul` over the 12 heads: x*cos + roll(x, D/2)*sin_signed, where
  sin_signed = (-sin, +sin) on the two halves is `rotate_half` folded into a table built once per step;
- RMSNorm is `F.rms_norm` with its weight, in place of norm-then-multiply;
- one Python loop over plain tensors, no module calls inside a layer;
- where the compiled kernels (`cpu_kernels`) are built: the residual add and the next RMSNorm are one pass, and
  so is silu(gate) * up.

Weight-only INT8 models (`quantize_model(model, "int8")`) and W8A8 ones (`"w8a8-g32"`) are fused the same way: their
q/k/v and gate/up become one call of the compiled INT8 (W8A8) kernel each (`FusedInt8Linear`).

Same results as the reference `LlamaForCausalLM` to float32 round-off (tests/unit/test_cpu_linear.py), same
`hidden_states` interface, so the runner, the speculative decoders and the attention callables do not know which
model they run. Built by `cpu_view.pack_linears` for plain Llama models; the model the labs teach is unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lab_utils.engine.accel.cpu_kernels import cpu_kernels
from lab_utils.engine.accel.cpu_linear import (
    PackedLinear,
    int8_small_m_kernel,
    small_m_kernel,
    small_m_rows,
)
from lab_utils.models.llama import (
    AttentionFn,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    dense_causal_attention,
)
from lab_utils.quant.linear import Int8Linear, W8A8GroupLinear


class FusedPackedLinear(nn.Module):
    """Linears that read the same input, as one oneDNN-packed weight whose output is their outputs side by side.
    Row counts where MKL wins (see `PackedLinear`) run the original linears one by one, on the shared weights."""

    def __init__(self, linears: list[nn.Module], small_m: bool | None = None, kernels: bool | None = None) -> None:
        super().__init__()
        if any(lin.bias is not None for lin in linears):
            raise ValueError("FusedPackedLinear takes bias-free linears (Llama's)")
        self.weights = [lin.weight for lin in linears]  # shared with the source model, not registered twice
        self.in_features = linears[0].in_features
        self.out_features = sum(lin.out_features for lin in linears)
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat([w.detach() for w in self.weights]))
        self.mkl_min_rows = PackedLinear.min_rows_for_mkl(self.out_features)
        self.small_m_rows, self.kernels = small_m_rows(self.in_features, small_m), kernels
        self.detached = [w.detach() for w in self.weights]  # the same storage, for the compiled kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if PackedLinear.plain_path(x, self.in_features, self.mkl_min_rows):
            return torch.cat([F.linear(x, w) for w in self.weights], dim=-1)
        few_rows = x.numel() <= self.small_m_rows * self.in_features
        if few_rows and (module := small_m_kernel(self.kernels)) is not None:
            return module.small_m_linear(x.contiguous(), self.detached)  # outputs side by side, no weight copy
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


class FusedInt8Linear(nn.Module):
    """INT8 linears (all weight-only `Int8Linear`s or all `W8A8GroupLinear`s) that read the same input, as one call of
    the compiled INT8 (or W8A8) kernel whose outputs sit side by side (few rows); other row counts run each
    linear's own forward."""

    def __init__(self, linears: list[nn.Module], small_m: bool | None = None, kernels: bool | None = None) -> None:
        super().__init__()
        if any(lin.bias is not None for lin in linears):
            raise ValueError("FusedInt8Linear takes bias-free linears (Llama's)")
        self.linears = linears  # a plain list: shared with the source model, not registered twice
        self.qweights = [lin.qweight for lin in linears]
        self.scale = torch.cat([lin.scale for lin in linears])  # tiny: one float per output row
        self.in_features = linears[0].in_features
        self.small_m_rows, self.kernels = small_m_rows(self.in_features, small_m, int8=True), kernels
        self.w8a8 = type(linears[0]) is W8A8GroupLinear  # (`fusable` makes them all one kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = int8_small_m_kernel(x, self.small_m_rows * self.in_features, self.w8a8, self.kernels)
        if kernel is None:
            return torch.cat([lin(x) for lin in self.linears], dim=-1)
        return kernel(x.contiguous(), self.qweights, self.scale)


class FusedLlamaDecoderLayer(LlamaDecoderLayer):
    """A `LlamaDecoderLayer` (same parameters) with q/k/v and gate/up fused; set up by `fuse_layers`."""

    def fuse(self, small_m: bool | None = None, kernels: bool | None = None) -> None:
        a, m = self.self_attn, self.mlp
        fused = FusedInt8Linear if isinstance(a.q_proj, Int8Linear) else FusedPackedLinear  # (see `fusable`)
        # nn.Linears (or PackedLinears), or Int8Linears
        self.qkv = fused([a.q_proj, a.k_proj, a.v_proj], small_m, kernels)
        self.gate_up = fused([m.gate_proj, m.up_proj], small_m, kernels)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin_signed: torch.Tensor,
                attention: AttentionFn, kernels=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; delta: the previous layer's output, not yet added (None in the first layer), so
        that the add and this layer's first RMSNorm are one pass. Returns (x, this layer's output) likewise."""
        a, m = self.self_attn, self.mlp
        B, T, _ = x.shape
        hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        x, h = add_rms_norm(x, delta, self.input_layernorm, kernels)
        qkv = self.qkv(h)
        qk = qkv[..., : (hq + hkv) * d].view(B, T, hq + hkv, d)
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin_signed)  # RoPE on q and k at once
        v = qkv[..., (hq + hkv) * d:].view(B, T, hkv, d)
        out = attention(a.layer_idx, qk[:, :, :hq], qk[:, :, hq:], v)
        x, h = add_rms_norm(x, a.o_proj(out.reshape(B, T, hq * d)), self.post_attention_layernorm, kernels)
        return x, m.down_proj(silu_mul(self.gate_up(h), kernels))  # SwiGLU


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, norm: nn.Module, kernels=None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)): one pass with the compiled kernel (`cpu_kernels`), else PyTorch's ops."""
    if kernels is not None:
        if delta is None:
            return x, kernels.rms_norm(x, norm.weight, norm.eps)
        return tuple(kernels.add_rms_norm(x, delta, norm.weight, norm.eps))
    x = x if delta is None else x + delta
    return x, F.rms_norm(x, x.shape[-1:], norm.weight, norm.eps)


def silu_mul(gate_up: torch.Tensor, kernels=None) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate, up] (the fused gate/up linear's output)."""
    if kernels is not None:
        return kernels.silu_mul(gate_up)
    i = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :i]).mul_(gate_up[..., i:])


class FusedLlamaForCausalLM(LlamaForCausalLM):
    """The reference model's `hidden_states`, with the RoPE tables built once per call and fused layers."""

    kernels_on: bool | None = None  # the compiled norm/SwiGLU kernels: an engine's `cpu_kernels`, None its default

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      attention: AttentionFn = dense_causal_attention) -> torch.Tensor:
        positions = self.checked_positions(input_ids, positions)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)  # [B, T, D]
        half = cos.shape[-1] // 2
        sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # rotate_half's sign, folded in
        cos, sin_signed = cos.unsqueeze(2), sin_signed.unsqueeze(2)  # broadcast over heads
        # the compiled norm/SwiGLU kernels: float32 CPU inference only (no autograd through them)
        use = x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_grad_enabled()
        kernels = cpu_kernels(self.kernels_on) if use else None
        delta = None
        for layer in self.model.layers:
            x, delta = layer(x, delta, cos, sin_signed, attention, kernels)
        return add_rms_norm(x, delta, self.model.norm, kernels)[1]


_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", *_MLP_PROJECTIONS)


def _projection_kind(lin: nn.Module | None) -> str | None:
    """"fp32" (a plain bias-free float32 nn.Linear), "int8" (a bias-free weight-only `Int8Linear`), "w8a8" (a
    bias-free `W8A8GroupLinear`), else None."""
    if type(lin) is nn.Linear and lin.bias is None and lin.weight.dtype == torch.float32:
        return "fp32"
    if type(lin) in (Int8Linear, W8A8GroupLinear) and lin.bias is None and lin.scale.dtype == torch.float32:
        return "w8a8" if type(lin) is W8A8GroupLinear else "int8"
    return None


def fusable(model: nn.Module) -> bool:
    """Plain float32 Llama models only, whose projections are all plain float32 linears, all weight-only INT8
    (`quantize_model(..., "int8")`) or all W8A8 (`"w8a8-g32"`), the same maths per linear: subclasses may change the
    layer maths, other dtypes keep their norms, and other swapped projections (INT4, tensor-parallel shards) keep
    their own."""
    if type(model) is not LlamaForCausalLM or model.dtype != torch.float32:
        return False
    kinds = set()
    for layer in model.model.layers:
        if type(layer) is not LlamaDecoderLayer:
            return False
        for name in _PROJECTIONS:
            kinds.add(_projection_kind(getattr(layer.mlp if name in _MLP_PROJECTIONS else layer.self_attn, name, None)))
    return len(kinds) == 1 and None not in kinds


def fuse_layers(view: LlamaForCausalLM, small_m: bool | None = None, kernels: bool | None = None) -> None:
    """Turn a (packed) view of a Llama model into its fused form, in place. The view's parameters stay shared.
    `small_m`, `kernels`: the compiled kernels' switches (`cpu_linear`)."""
    for layer in view.model.layers:
        layer.__class__ = FusedLlamaDecoderLayer
        layer.fuse(small_m, kernels)
    view.__class__ = FusedLlamaForCausalLM
    view.kernels_on = kernels
