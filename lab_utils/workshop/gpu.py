"""A GPU box shared by the room: each learner's device and GPU KV budget, from the devices and the room's size.

    seats      = learners (+ 1 for the shared `lab_utils serve`, when the hub runs one)
    per device = ceil(seats / devices)                 kernels that share one card or MIG slice
    share      = 0.9 x device memory / per device      0.9: the engine's gpu_memory_utilization default; the
                                                       rest is the driver's and the allocator's slack
    kv budget  = min(4 GiB, (share - GPU_BASE) / 2)    per learner kernel (LAB_KV_CACHE_MEMORY_BYTES): the other
                                                       half is room for a second engine (labs compare two)
    server kv  = share - GPU_BASE                      the shared server holds one engine

Learner number k (the hub's user id, in the order accounts were made) gets device k mod devices
(CUDA_VISIBLE_DEVICES, round-robin); the shared server takes the first device. A MIG slice is named by its UUID
(`MIG-...`) and counts as a device of its own memory.

GPU_BASE is one kernel's device memory before KV, by arithmetic from the engine's sizing (`kv_budget.measure`):
the CUDA context (~0.5 GiB, outside torch's allocator), SmolLM2-135M's weights in bf16 twice (0.25 GiB each: the
engine's and the lab's transformers reference), the activations of a full 512-token step (under 0.1 GiB) and
allocator slack; 1.5 GiB in all. Not measured on a GPU here.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

GiB, MiB = 1 << 30, 1 << 20
UTILIZATION = 0.9  # EngineConfig.gpu_memory_utilization's default, as vLLM
GPU_BASE = int(1.5 * GiB)
MIN_GPU_KV = 64 * MiB
MAX_GPU_KV = 4 * GiB
DEVICE_ID = re.compile(r"^(\d+|(GPU|MIG)-[0-9A-Za-z-]+)$")  # what CUDA_VISIBLE_DEVICES takes


@dataclass(frozen=True)
class GpuRoom:
    devices: tuple[str, ...]  # device indices or GPU/MIG UUIDs, as CUDA_VISIBLE_DEVICES takes them
    device_bytes: int  # memory of each device (a MIG slice's own)
    learners: int
    server: bool = False  # one seat on the first device for the shared lab server

    def __post_init__(self) -> None:
        if not self.devices:
            raise ValueError("--gpus: name at least one device (an index, or a GPU-/MIG- UUID)")
        for d in self.devices:
            if not DEVICE_ID.match(d):
                raise ValueError(f"--gpus {d!r}: a device index (0, 1, ...) or a UUID (GPU-..., MIG-...)")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"--gpus {','.join(self.devices)}: a device is named twice")
        if self.kv_bytes < MIN_GPU_KV:
            fits = int(len(self.devices) * (UTILIZATION * self.device_bytes // (GPU_BASE + 2 * MIN_GPU_KV)))
            raise ValueError(
                f"{self.seats} seats on {len(self.devices)} device(s) of {self.device_bytes / GiB:.1f} GiB: "
                f"{self.share_bytes / GiB:.2f} GiB each, below the {(GPU_BASE + 2 * MIN_GPU_KV) / GiB:.2f} GiB one "
                f"learner's kernel needs; these devices hold at most {fits - self.server} learners")

    @property
    def seats(self) -> int:
        return self.learners + self.server

    @property
    def per_device(self) -> int:
        return math.ceil(self.seats / len(self.devices))

    @property
    def share_bytes(self) -> int:
        return int(UTILIZATION * self.device_bytes) // self.per_device

    @property
    def kv_bytes(self) -> int:
        return max(0, min(MAX_GPU_KV, (self.share_bytes - GPU_BASE) // 2))

    @property
    def server_kv_bytes(self) -> int:
        return self.share_bytes - GPU_BASE

    def device_for(self, learner_number: int) -> str:
        """The device of learner number `learner_number` (1, 2, ...): round-robin after the server's seat."""
        return self.devices[(learner_number - 1 + self.server) % len(self.devices)]

    def __str__(self) -> str:
        return (f"{self.seats} seat(s) on {len(self.devices)} device(s) of {self.device_bytes / GiB:.0f} GiB, "
                f"{self.per_device} a device: {self.share_bytes / GiB:.1f} GiB each, {self.kv_bytes / MiB:.0f} MiB "
                f"of GPU KV a learner kernel")


def device_memory(devices: list[str]) -> int:
    """Memory of the smallest named device, asked of torch (only for plain indices torch can see)."""
    import torch

    if not torch.cuda.is_available() or not all(d.isdigit() for d in devices):
        raise ValueError("--gpu-mem GIB: give each device's memory (torch sees no CUDA device, or the devices "
                         "are UUIDs)")
    return min(torch.cuda.get_device_properties(int(d)).total_memory for d in devices)
