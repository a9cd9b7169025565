"""Datasheet numbers for named accelerators, each with the page it comes from.

Peaks are the dense (no 2:4 sparsity) FP16/BF16 tensor-core rates, because serving runs dense 16-bit matmuls;
NVIDIA's headline figures with sparsity are exactly twice these. Memory bandwidth and capacity are the HBM/GDDR
figures. `link_bw` is the GPU-to-GPU bandwidth *per direction*: NVIDIA quotes NVLink as the bidirectional total
(A100 600 GB/s, H100/H200 900 GB/s), and a ring all-reduce sends and receives at once, so each direction gets half.
The L4 has no NVLink: it talks over PCIe Gen4 x16 (64 GB/s bidirectional, 32 GB/s each way).

Two numbers are not on any datasheet and are stated as assumptions: `link_latency_s` (a few microseconds per
collective on NVLink, more on PCIe) and `step_overhead_s` (scheduling and kernel launches per engine step).
The simulator is therefore an optimistic bound (real kernels reach perhaps 50–80% of these peaks); its use is
comparing designs on one set of assumptions, not predicting a production number to the millisecond.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense FLOP/s at the serving dtype
    mem_bw: float  # bytes/s, device memory
    mem_bytes: float  # device memory capacity
    link_bw: float  # bytes/s per direction to a peer device (NVLink, PCIe)
    link_latency_s: float = 5e-6  # per collective / per transfer (assumed)
    step_overhead_s: float = 2e-3  # per engine step: scheduler, launches, sampling (assumed for GPUs)
    seq_overhead_s: float = 0.0  # per scheduled sequence per step (metadata, sampling); fitted on the CPU
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("peak_flops", "mem_bw", "mem_bytes", "link_bw"):
            v = getattr(self, f)
            if not v > 0:
                raise ValueError(f"Hardware.{f}={v!r} is invalid: must be > 0")
        for f in ("link_latency_s", "step_overhead_s", "seq_overhead_s"):
            v = getattr(self, f)
            if v < 0:
                raise ValueError(f"Hardware.{f}={v!r} is invalid: must be >= 0")

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity where the roofline bends: below it a step is bound by memory bandwidth."""
        return self.peak_flops / self.mem_bw

    def with_(self, **changes) -> Hardware:
        return replace(self, **changes)


GPUS: dict[str, Hardware] = {
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
    # A100 80GB SXM: BF16 tensor 312 TFLOPS (624 sparse), HBM2e 2,039 GB/s, 80 GB, NVLink 600 GB/s
    "A100-80GB-SXM": Hardware("A100-80GB-SXM", 312 * TB, 2039 * GB, 80 * GB, 300 * GB,
                              source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                                     "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    # https://www.nvidia.com/en-us/data-center/h100/ (datasheet table, H100 SXM column)
    # BF16 tensor 1,979 TFLOPS with sparsity -> 989 dense, HBM3 3.35 TB/s, 80 GB, NVLink 900 GB/s
    "H100-SXM": Hardware("H100-SXM", 989 * TB, 3350 * GB, 80 * GB, 450 * GB,
                         source="https://www.nvidia.com/en-us/data-center/h100/"),
    # https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM column)
    # BF16 tensor 1,979 TFLOPS with sparsity -> 989 dense, HBM3e 4.8 TB/s, 141 GB, NVLink 900 GB/s
    "H200-SXM": Hardware("H200-SXM", 989 * TB, 4800 * GB, 141 * GB, 450 * GB,
                         source="https://www.nvidia.com/en-us/data-center/h200/"),
    # https://www.nvidia.com/en-us/data-center/l4/ (datasheet)
    # FP16/BF16 tensor 242 TFLOPS with sparsity -> 121 dense, GDDR6 300 GB/s, 24 GB, PCIe Gen4 x16 64 GB/s
    "L4": Hardware("L4", 121 * TB, 300 * GB, 24 * GB, 32 * GB, link_latency_s=15e-6,
                   source="https://www.nvidia.com/en-us/data-center/l4/"),
}


def gpu(name: str) -> Hardware:
    """A named GPU (case-insensitive; "H100" finds "H100-SXM")."""
    key = name.upper()
    for k, hw in GPUS.items():
        if k.upper() == key or k.upper().startswith(key + "-"):
            return hw
    raise ValueError(f"unknown GPU {name!r}: choose one of {sorted(GPUS)} or build a Hardware(...)")


def cpu_hardware(peak_flops: float, mem_bw: float, step_overhead_s: float, seq_overhead_s: float = 0.0,
                 mem_bytes: float = 8 * GB, link_bw: float = 5 * GB) -> Hardware:
    """'This CPU': its peaks are not from a datasheet but fitted to the real engine (`calibrate.fit_hardware`).
    `link_bw` stands for a local socket/shared-memory copy between processes (assumed)."""
    return Hardware("this-cpu", peak_flops, mem_bw, mem_bytes, link_bw, link_latency_s=50e-6,
                    step_overhead_s=step_overhead_s, seq_overhead_s=seq_overhead_s,
                    source="fitted on this machine by lab_utils.sim.calibrate")
