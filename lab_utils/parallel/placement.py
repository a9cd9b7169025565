"""Where the processes of labs 09 (TP/PP) and 10 (prefill/decode) run, from the lab's `DEVICE` and the GPUs present.

- CPU: every rank/worker on the CPU; gloo carries TP/PP traffic.
- One GPU: NCCL needs one GPU per rank (two ranks on one GPU are refused as duplicate GPUs), so the TP/PP split
  runs on the CPU with gloo and says so. The prefill and decode workers share the GPU, each capped at an explicit
  share of its memory (`gpu_memory_utilization`, vLLM's meaning), so neither takes the card.
- Two or more GPUs: NCCL with one rank per GPU (cuda:0, cuda:1, ...); the prefill worker on cuda:0 and the decode
  worker on cuda:1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lab_utils.device import resolve_device

SHARED_GPU_UTILIZATION = 0.4  # each P/D worker's share of one shared GPU (two of them leave 20 % free)


def _gpus(device) -> int:
    dev = resolve_device(device)
    return torch.cuda.device_count() if dev.type == "cuda" else 0


@dataclass(frozen=True)
class ParallelPlacement:
    device: str  # for run_parallel: "cuda" (rank r on cuda:r) or "cpu"
    backend: str  # "nccl" | "gloo"
    gpus: int
    note: str


def parallel_placement(device="auto", world_size: int = 2, gpus: int | None = None) -> ParallelPlacement:
    """How lab 09 runs TP/PP with `world_size` ranks on this machine (`gpus` overrides the count, for tests)."""
    n = _gpus(device) if gpus is None else gpus
    if n >= world_size:
        return ParallelPlacement("cuda", "nccl", n, f"NCCL, one rank per GPU (cuda:0..cuda:{world_size - 1})")
    if n == 1:
        return ParallelPlacement("cpu", "gloo", n, f"one GPU: NCCL needs one GPU per rank, so the {world_size}-rank "
                                 "split runs on the CPU with gloo (same tokens and bytes; CPU timings)")
    if n > 1:
        return ParallelPlacement("cpu", "gloo", n, f"{n} GPUs for {world_size} ranks: the split runs on the CPU "
                                 "with gloo (NCCL needs one GPU per rank)")
    return ParallelPlacement("cpu", "gloo", 0, "CPU: gloo between processes")


@dataclass(frozen=True)
class PDPlacement:
    prefill: str  # device of the prefill worker ("cpu", "cuda:0", ...)
    decode: str
    gpu_memory_utilization: float | None  # each worker's share when they share one GPU; None otherwise
    note: str


def pd_placement(device="auto", gpus: int | None = None) -> PDPlacement:
    """Where lab 10's prefill and decode workers run (`gpus` overrides the count, for tests)."""
    n = _gpus(device) if gpus is None else gpus
    if n >= 2:
        return PDPlacement("cuda:0", "cuda:1", None, "prefill on cuda:0, decode on cuda:1; the KV moves GPU -> host "
                           "-> pipe -> GPU (vLLM's NIXL/NCCL connectors move it GPU to GPU)")
    if n == 1:
        return PDPlacement("cuda:0", "cuda:0", SHARED_GPU_UTILIZATION,
                           f"one GPU shared: each worker gets {SHARED_GPU_UTILIZATION:.0%} of its memory for weights, "
                           "activations and KV; they share its compute, so prefill still slows decode down")
    return PDPlacement("cpu", "cpu", None, "CPU: both workers on the CPU's cores; the KV moves through a pipe")
