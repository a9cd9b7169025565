"""The engine's accelerations, behind one seam: nothing in the teaching core needs them to be correct.

The core (`engine`, `scheduler`, `block_manager`, `kv_cache`, `attention`, `model_runner`) computes every step
with plain PyTorch. This package makes the same steps faster, with the same results:
- on a CPU: the model's linears packed once for oneDNN and its layers fused (`cpu_view`, `cpu_linear`,
  `cpu_fused`), small C++ kernels (`cpu_kernels`, `csrc/`), decode attention read from the paged cache in place
  (`cpu_attention`), mixed steps split into decode and prefill groups (`split_attention`);
- on CUDA: FlexAttention over the paged cache (`flex_attention`) and decode steps replayed as CUDA graphs
  (`cuda_graphs`).
The core reaches it only through the names below; `LAB_CPU_KERNELS=0`, `LAB_CPU_PACKED_LINEAR=0` and
`enforce_eager=True` turn the pieces off for A/B measurements.
"""
from __future__ import annotations

from lab_utils.engine.accel.cpu_attention import MAX_KERNEL_QUERIES, CpuDecodeAttention, kernel_usable
from lab_utils.engine.accel.cpu_view import fast_linears
from lab_utils.engine.accel.cuda_graphs import runner_options
from lab_utils.engine.accel.split_attention import SplitMetadata, SplitPagedAttention

__all__ = [
    "MAX_KERNEL_QUERIES",
    "CpuDecodeAttention",
    "SplitMetadata",
    "SplitPagedAttention",
    "fast_linears",
    "kernel_usable",
    "runner_options",
]
