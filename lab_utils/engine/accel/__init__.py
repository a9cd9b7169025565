"""The engine's accelerations, behind one seam: nothing in the teaching core needs them to be correct.

The core (`engine`, `scheduler`, `block_manager`, `kv_cache`, `attention`, `model_runner`) computes every step
with plain PyTorch. This package makes the same steps faster, with the same results:
- the seam: `fast_linears` (the model a runner calls), `FastPaths` (which fast path a step takes, the attention
  callable it gets, the fallback when one fails: `fast_paths`), the attention backends by name ("sdpa" with
  "cpu_kernel" and "split", "flex": `attention_backends`), warm-up (`warmup`);
- on a CPU: the model's linears packed once for oneDNN and its layers fused (`cpu_view`, `cpu_linear`,
  `cpu_fused`), small C++ kernels (`cpu_kernels`, `csrc/`), decode attention read from the paged cache in place
  (`cpu_attention`), mixed steps split into decode and prefill groups (`split_attention`);
- on CUDA: the model's layers with q/k/v and gate/up fused and fewer ops per layer (`device_fused`),
  FlexAttention over the paged cache (`flex_attention`) and decode steps replayed as CUDA graphs from one
  persistent input buffer per bucket (`cuda_graphs`).
The core reaches it only through the names below. `EngineConfig`'s CPU switches (`cpu_kernels`,
`cpu_packed_linear`, `cpu_fused_layers`, `cpu_small_m_linear`; defaults from LAB_CPU_KERNELS=0 etc.) and
`enforce_eager=True` turn the pieces off for A/B measurements.
"""
from __future__ import annotations

from lab_utils.engine.accel.cpu_view import fast_linears
from lab_utils.engine.accel.fast_paths import FastPaths
from lab_utils.engine.accel.warmup import warm_up, warmup_shapes

__all__ = [
    "FastPaths",
    "fast_linears",
    "warm_up",
    "warmup_shapes",
]
