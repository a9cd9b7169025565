"""Device choice and honest timing: CUDA events on a GPU, perf_counter on a CPU, medians after warm-up."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """`"auto"` picks CUDA when present, else CPU. Asking for CUDA without one is an error, not a silent CPU run."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but no CUDA device is available; use device='cpu' or 'auto'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported; use 'auto', 'cpu' or 'cuda'")
    return dev


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (bf16 matmuls are slow on most laptop CPUs), bf16 on GPUs that support it."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str | torch.dtype | None, device: torch.device | str) -> torch.dtype:
    """A lab's `DTYPE` parameter as a torch dtype: `"auto"`/None = fp32 on CPU, bf16 on CUDA (`default_dtype`).

    Labs read it as `DTYPE = os.environ.get("LAB_DTYPE", "auto")` so CI can rehearse a GPU's bf16 on a CPU.
    """
    if isinstance(name, torch.dtype):
        return name
    if name is None or str(name).strip().lower() == "auto":
        return default_dtype(torch.device(device))
    key = str(name).strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; use 'auto', 'float32', 'bfloat16' or 'float16' "
                         "(e.g. LAB_DTYPE=bfloat16)")
    return _DTYPES[key]


def synchronize(device: torch.device | str) -> None:
    """Wait for `device`'s queued work (that device's, not the current one's: `cuda:1` is not `cuda:0`)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@dataclass
class Timing:
    """Times of repeated runs, in seconds."""

    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    def __repr__(self) -> str:
        return f"Timing(median={self.median * 1e3:.2f} ms, n={len(self.times)})"


def time_fn(fn: Callable[[], object], device: torch.device | str = "cpu", warmup: int = 1, repeat: int = 5) -> Timing:
    """Run `fn` `warmup` times untimed, then `repeat` times timed; CUDA events on a GPU so queued work counts."""
    dev = torch.device(device)
    for _ in range(warmup):
        fn()
    out = Timing()
    for _ in range(repeat):
        if dev.type == "cuda":
            with torch.cuda.device(dev):  # events on `dev`'s stream, not the current device's
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize(dev)
            out.times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.times.append(time.perf_counter() - t0)
    return out


def now() -> float:
    """Wall clock for request timestamps (TTFT, ITL): monotonic, in seconds."""
    return time.perf_counter()
