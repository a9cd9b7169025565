"""CPU fast path for linear layers: weights reordered once into oneDNN's blocked layout.

`F.linear` on a CPU calls MKL's sgemm, which repacks the weight on every call and picks a slow kernel for a
handful of rows: on a 2-core AVX2 machine a 5-row product with SmolLM2's lm head (49152 x 576) takes 2.6x as
long as a 1-row one, and the lm head alone is ~13% of a decode step. oneDNN can reorder the weight *once*
into the layout its kernels read (what vLLM's CPU backend and torch.compile's freezing pass do), after which a
product costs nearly the same for 1 and 5 rows and ~2x less at 1 row for the lm head. That matters twice here:
decode steps of small batches (continuous batching) and speculative verify steps of k+1 rows (lab 07).

The engine builds a *view* of the caller's model whose `nn.Linear`s are `PackedLinear`s: the caller's model is
not changed, and parameters are shared, not copied (the packed weight is the one extra copy). For a plain
Llama the view's layers are also fused (`cpu_fused`: q/k/v and gate/up packed as one weight each, fewer small
kernels). The packed weight is a snapshot taken when the engine is built, as vLLM's is: train the model, then
build a new engine.
Results equal `F.linear` to float32 round-off (different summation order), checked in tests/unit/test_cpu_linear.py.
It is the CPU's ordinary GEMM kernel, as in vLLM's CPU backend, not a compile-or-graph trick, so
`enforce_eager` leaves it on; `EngineConfig.cpu_packed_linear=False` (`LAB_CPU_PACKED_LINEAR=0`) turns it off
(for A/B measurements). Never used on CUDA, for non-float32 weights, or where oneDNN is missing.

The compiled kernels' switches reach each layer here as `small_m` (an engine's `cpu_small_m_linear`) and
`kernels` (its `cpu_kernels`); None stands for `EngineConfig`'s default (`config.cpu_switch_default`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lab_utils.engine.accel.cpu_kernels import cpu_kernels
from lab_utils.engine.config import cpu_switch_default
from lab_utils.quant.linear import Int8Linear, W8A8GroupLinear


def packed_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing pays for float32 on CPU; bf16/fp16 on a CPU without native support would be emulated."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


# Where MKL's own kernels win again (measured on the 2-core AVX2 VM, 1 and 2 threads, SmolLM2's shapes):
# many rows (a prefill chunk of a few hundred tokens, compute-bound): MKL's large-M GEMM, 5-10% faster.
# A vocabulary-sized output (the lm head) kept oneDNN ahead up to ~512 rows. At one row (a batch-1 decode)
# oneDNN wins too once the weights come from memory as in a real forward (30 layers' distinct weights, 420 MB):
# 22.5 vs 29.5 ms for SmolLM2's layer linears. (An earlier measurement that reused one layer's weights, which
# then sat in cache, had MKL's matrix-vector kernel ahead; with distinct weights it is not.)
# With the small-M kernel below taking up to 64 rows (benchmarks/small_m_gemm.py): on 2 threads oneDNN
# is 7% ahead of MKL at 128 rows (231 vs 247 ms for all of SmolLM2's linears) and 4% behind at 192; on 1 thread
# level at 96, MKL 3% ahead at 128.
# On an AVX-512 CPU (a 2-core Xeon VM) oneDNN runs its AVX-512 kernels and MKL never catches up: 143 vs 335 ms
# at 192 rows on 2 threads, 533 vs 1223 ms at 384 rows on 1 thread; there the plain path is never taken.
WIDE_OUTPUT = 16384


# Up to this many rows (a decode step's batch, a verify step's k+1 rows) the compiled small-M kernel
# (`csrc/small_m_linear.cpp`: each weight row read once, straight from the model's layout, into all rows of x)
# beats oneDNN's packed GEMM on the 2-core AVX2 VM (benchmarks/small_m_gemm.py, SmolLM2's linears): 2 threads
# 1.21x at 1 row, 1.27-1.31x at 2-8, 1.20x at 16, 1.09x at 64, level at 128; 1 thread 1.10x at 1 row, 1.04x at 64.
# On an AVX-512 CPU oneDNN's AVX-512 GEMM is level with the kernel up to 8 rows (2 threads 1.06x at 1 row, 0.94x
# at 8) and well ahead beyond (0.63x at 16, 0.62x at 64, 0.55x at 128): the kernel stops at 8 rows there.
# The INT8 kernels read a quarter of the bytes and have no oneDNN rival; they keep the AVX2 limit everywhere.
# `cpu_small_m_linear=False` (LAB_CPU_SMALL_M_LINEAR=0) turns it off (A/B); it needs in_features % 8 == 0 and an
# AVX2 build.


@dataclass(frozen=True)
class LinearLimits:
    """Which kernel a float32 linear runs, by rows of input, on one kind of CPU (benchmarks/small_m_gemm.py)."""

    small_m_max_rows: int  # up to this many rows: the compiled small-M kernel
    mkl_min_rows_per_thread: int  # from this many rows per thread: MKL's plain GEMM (F.linear)
    mkl_min_rows_per_thread_wide: int  # the same for a vocabulary-sized output (the lm head)


NEVER = 1 << 40
LIMITS = {
    "AVX2": LinearLimits(64, 96, 512),
    "AVX512": LinearLimits(8, NEVER, NEVER),
}
INT8_SMALL_M_MAX_ROWS = 64


def linear_limits(capability: str | None = None) -> LinearLimits:
    """The limits measured for this CPU's vector width (`torch.backends.cpu.get_cpu_capability()`, which
    ATEN_CPU_CAPABILITY=avx2 forces down); a CPU measured on neither uses the AVX2 figures."""
    capability = capability or torch.backends.cpu.get_cpu_capability()
    return LIMITS.get(capability, LIMITS["AVX2"])


SMALL_M_MAX_ROWS = linear_limits().small_m_max_rows


def small_m_rows(in_features: int, small_m: bool | None = None, int8: bool = False) -> int:
    """Up to how many rows a packed linear (an INT8 one if `int8`) tries the compiled small-M kernel (used only
    while `cpu_kernels()` is built and not switched off; else oneDNN as before)."""
    on = cpu_switch_default("cpu_small_m_linear") if small_m is None else small_m
    rows = INT8_SMALL_M_MAX_ROWS if int8 else linear_limits().small_m_max_rows
    return rows if in_features % 8 == 0 and on else 0


def small_m_kernel(kernels: bool | None = None):
    """The compiled kernels' module when its small-M GEMM is the vectorised (AVX2) one, else None: oneDNN then."""
    module = cpu_kernels(kernels)
    return module if module is not None and module.small_m_vectorized else None


def int8_small_m_kernel(x: torch.Tensor, max_numel: int, w8a8: bool, kernels: bool | None = None):
    """The compiled INT8 kernel (W8A8 if `w8a8`) for `x` where it applies (float32 inference, at most `max_numel`
    elements: the small-M rows, an AVX2 build), else None: the INT8 layers' own forward then."""
    if x.dtype != torch.float32 or x.requires_grad or x.numel() > max_numel:
        return None
    if (module := small_m_kernel(kernels)) is None:
        return None
    return module.small_m_linear_w8a8 if w8a8 else module.small_m_linear_int8


class PackedLinear(nn.Module):
    """An `nn.Linear` (no bias or with bias) whose weight is reordered once for oneDNN; a few rows go to the
    compiled small-M kernel where it is built (`LinearLimits`), the row counts where MKL is faster (a large
    prefill chunk) to the plain `F.linear` on the shared weight."""

    def __init__(self, linear: nn.Linear, small_m: bool | None = None, kernels: bool | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # shared with the source model (tied embeddings, `.weight` readers)
        self.bias = linear.bias
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.mkl_min_rows = self.min_rows_for_mkl(self.out_features)
        self.small_m_rows, self.kernels = small_m_rows(self.in_features, small_m), kernels

    @staticmethod
    def min_rows_for_mkl(out_features: int) -> int:
        """From how many rows of input MKL's plain GEMM beats the packed kernel (`LinearLimits`)."""
        limits = linear_limits()
        wide = out_features >= WIDE_OUTPUT
        per_thread = limits.mkl_min_rows_per_thread_wide if wide else limits.mkl_min_rows_per_thread
        return per_thread * torch.get_num_threads()

    @staticmethod
    def plain_path(x: torch.Tensor, in_features: int, mkl_min_rows: int) -> bool:
        """Whether `x` goes to plain `F.linear`: enough rows for MKL (`LinearLimits`), training, dtypes."""
        return x.dtype != torch.float32 or x.requires_grad or x.numel() // in_features >= mkl_min_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain_path(x, self.in_features, self.mkl_min_rows):
            return nn.functional.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        few_rows = x.numel() <= self.small_m_rows * self.in_features
        if few_rows and (module := small_m_kernel(self.kernels)) is not None:
            return module.small_m_linear(x.contiguous(), [self.weight.detach()], bias)  # the live weight
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, oneDNN-packed"


class SmallMInt8Linear(nn.Module):
    """A weight-only INT8 linear (`lab_utils.quant.linear.Int8Linear`) or a W8A8 one (`W8A8GroupLinear`) whose few-row
    products run the compiled INT8 (W8A8) small-M kernel (a quarter of the fp32 bytes to read); everything else
    runs its own forward."""

    def __init__(self, linear: nn.Module, small_m: bool | None = None, kernels: bool | None = None) -> None:
        super().__init__()
        self.inner = linear  # shares qweight / scale / bias with the source model
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.small_m_rows, self.kernels = small_m_rows(self.in_features, small_m, int8=True), kernels
        self.w8a8 = type(linear) is W8A8GroupLinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = int8_small_m_kernel(x, self.small_m_rows * self.in_features, self.w8a8, self.kernels)
        if kernel is None:
            return self.inner(x)
        lin = self.inner
        return kernel(x.contiguous(), [lin.qweight], lin.scale, lin.bias)
