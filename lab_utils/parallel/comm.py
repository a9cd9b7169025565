"""Timed, byte-counted wrappers around torch.distributed, so a run can say what share of a step was talking.

Every collective or point-to-point call of the parallel runners goes through one `Comm`. It records the time
spent inside the call (after a device sync on CUDA, where NCCL calls only enqueue work) and the payload bytes
(the tensor's size; a ring all-reduce moves 2(W-1)/W of that per rank on the wire).
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def free_tcp_port() -> int:
    """A port the OS says is free now, for the rendezvous of one run (tests run in parallel with other jobs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_backend(backend: str, device: str) -> str:
    """`auto`: NCCL for CUDA tensors, gloo for CPU tensors (NCCL cannot move CPU tensors, gloo is slow on GPUs)."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is invalid: must be 'auto', 'gloo' or 'nccl'")
    if backend == "auto":
        return "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise ValueError("backend='nccl' needs device='cuda' (NCCL moves GPU tensors only); use 'gloo' on CPU")
    return backend


@dataclass
class Comm:
    """This rank's view of the process group, with a stopwatch and a byte counter."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seconds: float = 0.0
    bytes: int = 0
    calls: int = 0

    def _timed(self, fn, t: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - t0
        self.bytes += t.numel() * t.element_size()
        self.calls += 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over all ranks, in place (the row-parallel linears' partial sums)."""
        if self.world_size > 1:
            self._timed(lambda: dist.all_reduce(t), t)
        return t

    def send(self, t: torch.Tensor, dst: int) -> None:
        self._timed(lambda: dist.send(t.contiguous(), dst), t)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        self._timed(lambda: dist.recv(t, src), t)
        return t

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        if self.world_size > 1:
            self._timed(lambda: dist.broadcast(t, src), t)
        return t

    def reset(self) -> None:
        self.seconds, self.bytes, self.calls = 0.0, 0, 0
