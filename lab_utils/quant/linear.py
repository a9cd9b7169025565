"""Weight-only quantized linear layers that replace `nn.Linear`, and `quantize_model` to swap them in.

- `Int8Linear`: symmetric INT8, one scale per output channel. Since the scale belongs to an output row,
  `x @ (s·q)ᵀ = (x @ qᵀ)·s`: convert q to the activation dtype, one matmul, then scale the outputs.
- `Int4Linear`: INT4, one fp16 scale (and, if asymmetric, a zero-point byte) per group of `group_size` inputs
  of each row, two values packed per byte. Per-group scales do not factor out of the matmul, so the weight is
  dequantized (unpack → scale) before it. Memory falls ~7× vs fp32; time does not: on a CPU, without a fused
  kernel, unpacking costs more than the fp32 matmul it replaces. Decode on a GPU is bound by reading weights, so
  a fused kernel there turns fewer bytes into speed; here we measure and report whatever we get.

- `W8A8Linear`: W8A8 as vLLM and SmoothQuant mean it: `Int8Linear`'s per-channel weights, and each token's
  activations rounded to INT8 on the fly with one scale per token (dynamic, vLLM's `scaled_int8_quant` with no
  scale given). Both scales factor out of the sum over inputs, x @ Wᵀ ≈ (x_q @ q_wᵀ) · s_x[token] · s_w[channel],
  so the layer is one integer matmul (int8 × int8 → int32, `int8_matmul`) and one scaling of its output: the
  shape of vLLM's W8A8 int8 path (`CompressedTensorsW8A8Int8`,
  `vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w8a8_int8.py`, through
  `cutlass_scaled_mm`).
- `W8A8GroupLinear` (method `"w8a8-g32"`): the same weights, activations with one scale per **32 inputs** of each
  token (the block size of the OCP MX formats). Finer scales keep SmolLM2's outlier channels from flattening the
  rest of a token, at a price: per-group scales do not factor out of the sum, so the product is one integer dot
  per group, x @ Wᵀ ≈ Σ_g (x_q,g @ q_w,gᵀ) · s_x,g · s_w, which a CPU computes 32 at a time with byte
  dot-product instructions (`lab_utils/engine/accel/csrc/small_m_linear.cpp`).

`Int8Linear` and `Int4Linear` keep activations in floating point (weight-only quantization), so they drop into
any model; the W8A8 layers do too, with the extra activation error.

The arithmetic is in three small functions, `quantize_per_channel_int8`, `quantize_per_group_int4` and
`dequantize_int4`; lab 05's learner writes their own, and `quantize_model(..., quantize_int8=, quantize_int4=,
dequantize_int4=)` (the engine passes them from its `EngineParts`) builds the layers with those instead.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lab_utils.quant.formats import (
    compute_qparams,
    pack_int4,
    qrange,
    quantize_int,
    unpack_int4,
)

METHODS = ("int8", "int4", "w8a8", "w8a8-g32")


def quantize_per_channel_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8, one scale per output row: q = round(w / s) in -127..127, s = max|row| / 127 (1 for a zero
    row). Returns (q int8 [out, in], s float32 [out, 1])."""
    amax = w.float().abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.clamp(torch.round(w.float() / scale), -127, 127).to(torch.int8)
    return q, scale


def quantize_per_group_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4, one scale per `group_size` inputs of a row: s = max|group| / 7, stored in fp16 and rounded
    *up* to an fp16 value (so the group's largest weight still fits), q = round(w / stored s) in -7..7.
    Returns (q int8 [out, in], s float16 [out, in / group_size]): the integers agree with the scale kept."""
    g = w.float().reshape(w.shape[0], -1, group_size)
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 7, torch.ones_like(amax))
    s16 = scale.half()
    s16 = torch.where(s16.float() < scale, torch.nextafter(s16, torch.full_like(s16, math.inf)), s16)
    q = torch.clamp(torch.round(g / s16.float()), -7, 7).to(torch.int8)
    return q.reshape(w.shape), s16.squeeze(-1)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """q [out, in] (integers) times its group's scale [out, in / group_size], in the scale's dtype."""
    g = q.to(scale.dtype).reshape(q.shape[0], -1, group_size)
    return (g * scale.unsqueeze(-1)).reshape(q.shape)


def _checked(what: str, q: torch.Tensor, scale: torch.Tensor, q_shape, scale_shape, lo: int, hi: int) -> None:
    """A quantizer passed in (a learner's) must return what the layer stores; say what is wrong if not."""
    if not (isinstance(q, torch.Tensor) and isinstance(scale, torch.Tensor)):
        raise ValueError(f"{what} must return two tensors (q, scale)")
    if tuple(q.shape) != tuple(q_shape) or scale.numel() != math.prod(scale_shape):
        raise ValueError(f"{what} returned q {tuple(q.shape)} and scale {tuple(scale.shape)}; the layer needs "
                         f"q {tuple(q_shape)} and scale {tuple(scale_shape)}")
    if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
        raise ValueError(f"{what} returned integers in {int(q.min())}..{int(q.max())}; allowed {lo}..{hi}")


class Int8Linear(nn.Module):
    """y = (x @ qᵀ) · scale + bias, q int8 [out, in], scale [out] (fp32: it is tiny)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, quantize: Callable | None = None) -> Int8Linear:
        """`quantize(w) -> (q, scale)`: the per-channel quantizer (default `quantize_per_channel_int8`)."""
        m = cls(linear.in_features, linear.out_features, linear.bias is not None)
        w = linear.weight.detach()
        q, scale = (quantize or quantize_per_channel_int8)(w)
        _checked("the INT8 quantizer", q, scale, w.shape, (w.shape[0], 1), -127, 127)
        m.qweight = q.to(device=w.device, dtype=torch.int8)
        m.scale = scale.reshape(-1).to(device=w.device, dtype=torch.float32)
        if linear.bias is not None:
            m.bias = linear.bias.detach().clone()
        return m

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.float() * self.scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the fp32 scale multiplies the matmul's output (type promotion: fp32), then one rounding to x's dtype;
        # a scale rounded to bf16 first would put up to 2^-9 relative error on every output of the row
        y = (F.linear(x, self.qweight.to(x.dtype)) * self.scale).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def _apply(self, fn, recurse: bool = True):
        """`.to(dtype)` moves the scale with the layer but keeps it fp32 (`.to(bfloat16)` would round it)."""
        scale = self.scale
        super()._apply(fn, recurse)
        self.scale = scale.to(device=self.scale.device, dtype=torch.float32)
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


ACT_GROUP = 32  # w8a8-g32: inputs per activation scale (the block size of the OCP MX formats; SmolLM2: 576 = 18 x 32)


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic INT8 for activations, one scale per token (each row of the last dim): round(x / s) in
    [-127, 127], s = absmax / 127 (1 for an all-zero token). Returns (q int8 like x, s float32 [..., 1])."""
    xf = x.float()
    absmax = xf.abs().amax(-1, keepdim=True)
    s = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax))
    return torch.round(xf / s).clamp_(-127, 127).to(torch.int8), s


def int8_matmul(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """xq [m, k] int8 times wq [n, k] int8 transposed: the exact int32 sums [m, n]. `torch._int_mm` where it
    runs (CPU; CUDA when m > 16 and k, n are multiples of 8), else float64, whose sums of int8 products stay
    exact integers (below 2^53)."""
    if xq.dtype != torch.int8 or wq.dtype != torch.int8:
        raise ValueError(f"int8_matmul takes int8 operands, got {xq.dtype} and {wq.dtype}")
    m, k = xq.shape
    n = wq.shape[0]
    if hasattr(torch, "_int_mm") and (not xq.is_cuda or (m > 16 and k % 8 == 0 and n % 8 == 0)):
        return torch._int_mm(xq.contiguous(), wq.t().contiguous())
    return (xq.double() @ wq.double().t()).to(torch.int32)


class W8A8Linear(Int8Linear):
    """y = (x_q @ qᵀ) · s_x · scale + bias: `Int8Linear`'s per-channel weights, x rounded to INT8 with one scale
    per token (`quantize_per_token_int8`); one int8 matmul, both scales applied to its int32 output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        xq, sx = quantize_per_token_int8(flat)
        acc = int8_matmul(xq, self.qweight)
        y = (acc.float() * sx * self.scale).reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel weights, "
                f"int8 activations per token")


def quantize_groups_int8(x: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic INT8 for activations: each run of `group` values along the last dim as round(x / s) in [-127, 127],
    s = absmax / 127 (1 for an all-zero group). Returns (q int8 like x, s float32 [..., K / group]). The compiled
    kernel rounds identically (x * (1/s), s = absmax * (1/127), written so here too)."""
    if x.shape[-1] % group:
        raise ValueError(f"activation quantization in groups of {group} needs in_features divisible by {group}, "
                         f"got {x.shape[-1]}")
    xg = x.float().reshape(*x.shape[:-1], -1, group)
    absmax = xg.abs().amax(-1, keepdim=True)
    s = torch.where(absmax > 0, absmax * torch.tensor(1 / 127, dtype=torch.float32), torch.ones_like(absmax))
    q = torch.round(xg * (1 / s)).clamp_(-127, 127).to(torch.int8)
    return q.reshape(x.shape), s.squeeze(-1)


class W8A8GroupLinear(Int8Linear):
    """Method "w8a8-g32": y = Σ_g (x_q,g @ q_gᵀ) · s_x,g · scale + bias: `Int8Linear`'s weights, x rounded to INT8
    on the fly with one scale per 32 inputs of each token (`quantize_groups_int8`); here as
    dequantize-then-matmul, in the CPU kernel as integer dots."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, quantize: Callable | None = None) -> W8A8GroupLinear:
        if linear.in_features % ACT_GROUP:
            raise ValueError(f"w8a8-g32 needs in_features divisible by {ACT_GROUP} (one activation scale per "
                             f"{ACT_GROUP} inputs), got {linear.in_features}; use w8a8 (one scale per token) or "
                             f"int8 (weight-only) for this layer")
        return super().from_linear(linear, quantize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, s = quantize_groups_int8(x)
        xd = (xq.float().reshape(*x.shape[:-1], -1, ACT_GROUP) * s.unsqueeze(-1)).reshape(x.shape)
        y = (F.linear(xd, self.qweight.float()) * self.scale).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel weights, "
                f"int8 activations per {ACT_GROUP} inputs")


W8A8_CLASSES = {"w8a8": W8A8Linear, "w8a8-g32": W8A8GroupLinear}


class Int4Linear(nn.Module):
    """Group-wise INT4: W[o, g·G + j] ≈ scale[o, g] · (q[o, g·G + j] − zero[o, g]), q packed two per byte."""

    def __init__(self, in_features: int, out_features: int, group_size: int = 64, symmetric: bool = True,
                 bias: bool = False) -> None:
        super().__init__()
        check_group_size(in_features, group_size)
        self.in_features, self.out_features = in_features, out_features
        self.group_size, self.symmetric = group_size, symmetric
        n_groups = in_features // group_size
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.ones(out_features, n_groups, dtype=torch.float16))
        self.register_buffer("zeros", None if symmetric else torch.zeros(out_features, n_groups, dtype=torch.uint8))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self.dequantize = dequantize_int4  # (q, scale, group_size) -> weight; runs in every forward

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 64, symmetric: bool = True,
                    quantize: Callable | None = None, dequantize: Callable | None = None) -> Int4Linear:
        """Symmetric: `quantize(w, group_size) -> (q, scale)` (default `quantize_per_group_int4`) and
        `dequantize(q, scale, group_size)` (default `dequantize_int4`). Asymmetric: zero-points, built here."""
        m = cls(linear.in_features, linear.out_features, group_size, symmetric, linear.bias is not None)
        w = linear.weight.detach().float()
        if dequantize is not None:
            m.dequantize = dequantize
        if symmetric:
            q, scale = (quantize or quantize_per_group_int4)(w, group_size)
            _checked("the INT4 quantizer", q, scale, w.shape, (w.shape[0], w.shape[1] // group_size), -8, 7)
            m.qweight = pack_int4(q).to(w.device)
            m.scales = scale.reshape(m.scales.shape).to(device=w.device, dtype=torch.float16)
            if linear.bias is not None:
                m.bias = linear.bias.detach().clone()
            return m
        scale, zp = compute_qparams(w, 4, symmetric, "group", group_size)
        # Scales are stored in fp16. Round each one *up* to an fp16 value (so the group's range still fits: no
        # clipping) and choose the integers with that stored scale, so stored ints and stored scale agree.
        s16 = scale.clamp(min=torch.finfo(torch.float16).tiny, max=torch.finfo(torch.float16).max).half()
        s16 = torch.where(s16.float() < scale, torch.nextafter(s16, torch.full_like(s16, torch.inf)), s16)
        scale = s16.float()
        if not symmetric:
            lo = w.view(w.shape[0], -1, group_size).amin(-1, keepdim=True).clamp(max=0)
            zp = torch.clamp(-torch.round(lo / scale), 0, 15)
        qt = quantize_int(w, 4, symmetric, "group", group_size, scale=scale, zero_point=zp)
        m.qweight = pack_int4(qt.q).to(w.device)
        m.scales = qt.scale.to(device=w.device, dtype=torch.float16)
        if not symmetric:
            m.zeros = qt.zero_point.to(device=w.device, dtype=torch.uint8)
        if linear.bias is not None:
            m.bias = linear.bias.detach().clone()
        return m

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.zeros is None:
            w = self.dequantize(unpack_int4(self.qweight, signed=True), self.scales.to(dtype), self.group_size)
            return w.to(dtype)
        q = unpack_int4(self.qweight, signed=self.symmetric).to(dtype)
        q = q.view(self.out_features, -1, self.group_size)
        if self.zeros is not None:
            q = q - self.zeros.to(dtype).unsqueeze(-1)
        return (q * self.scales.to(dtype).unsqueeze(-1)).view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        kind = "symmetric" if self.symmetric else "asymmetric"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 {kind}, group_size={self.group_size}")


def check_group_size(in_features: int, group_size: int) -> None:
    if group_size < 2 or group_size % 2 or in_features % group_size:
        ok = [g for g in (16, 32, 64, 96, 128, 192, 256) if in_features % g == 0]
        raise ValueError(
            f"group_size={group_size} must be even and divide in_features={in_features}; e.g. one of {ok}"
        )


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of all parameters and buffers, each storage counted once (tied embeddings are shared)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + [b for b in module.buffers() if b is not None]:
        key = (t.untyped_storage().data_ptr(), t.device)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def linear_targets(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> list[tuple[str, nn.Linear]]:
    """Every `nn.Linear` except those whose name contains one of `skip` (lm_head is tied to the embedding)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and not any(s in n for s in skip)]


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


@torch.no_grad()
def quantize_model(model: nn.Module, method: str = "int8", group_size: int = 64, symmetric: bool = True,
                   skip: tuple[str, ...] = ("lm_head",), quantize_int8: Callable | None = None,
                   quantize_int4: Callable | None = None,
                   dequantize_int4: Callable | None = None) -> tuple[nn.Module, int]:
    """Replace the model's linear layers by quantized ones, in place.

    method: "int8" (weight-only, per output channel), "w8a8" (the same weights; activations rounded to INT8 on
    the fly, one scale per token: vLLM's W8A8), "w8a8-g32" (one activation scale per 32 inputs of each token) or
    "int4" (weight-only, group-wise, `group_size` inputs per scale, packed).
    Embeddings, norms and the (tied) lm_head stay in their dtype. Returns (model, bytes saved).
    `quantize_int8` / `quantize_int4` / `dequantize_int4`: other versions of the arithmetic (a learner's), None =
    this module's.
    """
    if method not in METHODS:
        raise ValueError(f"quantization={method!r}; allowed: {', '.join(METHODS)}")
    targets = linear_targets(model, skip)
    if not targets:
        raise ValueError("the model has no nn.Linear layers to quantize (already quantized?)")
    if method == "int4":
        for name, lin in targets:
            try:
                check_group_size(lin.in_features, group_size)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
    before = tensor_bytes(model)
    for name, lin in targets:
        if method == "int4":
            new = Int4Linear.from_linear(lin, group_size, symmetric, quantize_int4, dequantize_int4)
        else:
            new = W8A8_CLASSES.get(method, Int8Linear).from_linear(lin, quantize_int8)
        _set_module(model, name, new)
    return model, before - tensor_bytes(model)


def bits_per_weight(method: str, group_size: int = 64, symmetric: bool = True, in_features: int = 576,
                    scale_bits: int = 16) -> float:
    """Average storage per weight, scales included: int8 (and both w8a8) → 8 + 32/in; int4 → 4 + 16/G (+ 8/G with
    zero-points)."""
    if method in ("int8", "w8a8", "w8a8-g32"):
        return 8 + 32 / in_features
    if method == "int4":
        return 4 + scale_bits / group_size + (0 if symmetric else 8 / group_size)
    raise ValueError(f"method={method!r}; allowed: {', '.join(METHODS)}")


__all__ = ["Int4Linear", "Int8Linear", "W8A8GroupLinear", "W8A8Linear", "bits_per_weight", "dequantize_int4",
           "int8_matmul", "linear_targets", "qrange", "quantize_groups_int8", "quantize_model",
           "quantize_per_channel_int8", "quantize_per_group_int4", "quantize_per_token_int8", "tensor_bytes"]
