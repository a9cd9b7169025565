"""The engine's compiled CPU kernels: built once from `csrc/`, or None where they cannot be.

After the GEMMs are packed (`cpu_linear`) and the layers fused (`cpu_fused`), what is left of a small CPU
decode step is many small kernels: attention's gather/mask/SDPA/scatter, RMSNorm's six element-wise passes,
SwiGLU's two. Each costs microseconds of dispatch and an OpenMP fork/join for little work. `csrc/` holds the
few plain C++ loops that replace them (the same idea as vLLM's CPU backend kernels):

- `paged_decode_attention.cpp`: decode attention reading the paged KV cache in place (`cpu_attention`);
- `layer_ops.cpp`: RMSNorm, residual add + RMSNorm, silu(gate) * up, one pass each (`cpu_fused`);
- `small_m_linear.cpp`: the linears of a decode step (a few rows), each weight row read once (`cpu_linear`):
  with so few rows the GEMM is bound by reading the weights, and oneDNN's general kernel reads them slower;
  its INT8 variant serves weight-only INT8 linears (`quantization="int8"`, a quantized draft), its W8A8 variant
  INT8 weights with INT8 activations (`"w8a8-g32"`: byte dot products, no widening of the weights to float).

They are compiled on first use by `torch.utils.cpp_extension` (g++ and ninja; ~30-90 s once, with a one-line
message, then cached in `cache_dir()/torch_extensions`, one folder per Python environment and CPU capability).
A start that finds the leftovers of a killed build cleans them and builds again; a wait for another process's
build is bounded (`LAB_CPU_KERNELS_LOCK_TIMEOUT`, default 900 s) and then keeps PyTorch's ops. Where that fails (no compiler) the engine warns once and keeps the PyTorch
ops (and oneDNN for the linears), which compute the same thing: `cpu_kernels_status()` says which is in use.
`EngineConfig.cpu_kernels=False` (default from `LAB_CPU_KERNELS=0`) turns the kernels off (A/B measurements).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # Windows: no file locks (and rarely a compiler torch can use)
    fcntl = None

from lab_utils.engine.config import cpu_switch_default
from lab_utils.paths import cache_dir

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in
           ("paged_decode_attention.cpp", "layer_ops.cpp", "small_m_linear.cpp", "bindings.cpp")]
# -fopenmp: ATen's parallel_for is OpenMP code inlined from its header; the extension then shares torch's own
# libgomp (same soname, already loaded). -ffast-math lets exp vectorise (softmax, silu).
_ISA = {"AVX2": ["-mavx2", "-mfma"], "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"]}
NAME = "lab_cpu_kernels"
BUILT_STAMP = "built.ok"      # written after a build loaded: its absence means the next start compiles
TORCH_LOCK = "lock"           # PyTorch's own build lock (torch.utils.file_baton): left behind by a killed build
# How long a start waits for another process's build of the same folder before giving up (and keeping PyTorch's
# ops). A build takes ~30-90 s on 2 cores; several queued starts each wait for the one build, not one each.
LOCK_TIMEOUT_S = float(os.environ.get("LAB_CPU_KERNELS_LOCK_TIMEOUT", "900"))
_state: dict[str, object] = {}


def _flags() -> list[str]:
    return ["-O3", "-ffast-math", "-fopenmp", *_ISA.get(torch.backends.cpu.get_cpu_capability(), [])]


def _environment() -> list[str]:
    """What the build reads from the Python environment: torch's headers (found through torch's own path, so
    two environments with two torch installs differ) and Python's. PyTorch writes these paths into the build
    file; a folder shared by two environments would be rebuilt by each in turn."""
    from torch.utils.cpp_extension import include_paths

    return [*include_paths(), sysconfig.get_paths()["include"], sys.prefix]


def _build_dir() -> Path:
    """One folder per sources, flags, torch version, CPU capability and Python environment: a changed kernel,
    another CPU or another environment builds once into its own folder; two checkouts with one environment
    share one build (the sources are copied into the folder, so their location does not matter)."""
    capability = torch.backends.cpu.get_cpu_capability()  # e.g. AVX2, AVX512, DEFAULT
    digest = hashlib.sha256(" ".join(_flags()).encode() + torch.__version__.encode())
    digest.update("\0".join(_environment()).encode())
    for src in SOURCES:
        digest.update(src.read_bytes())
    return cache_dir() / "torch_extensions" / f"{NAME}-{capability.lower()}-{digest.hexdigest()[:12]}"


def _say(message: str) -> None:
    """One line on stderr: a notebook shows it under the cell, a server's log gets it, nbval does not compare it."""
    print(message, file=sys.stderr, flush=True)


def _lock_exclusively(lock, path: Path, timeout_s: float) -> None:
    """Wait for the folder's build lock at most `timeout_s`. flock is released when its holder dies, so a wait
    that reaches the limit means a live process has been building (or hanging) that long."""
    deadline, said = time.monotonic() + timeout_s, False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if not said:
                _say(f"lab_utils: waiting for another process that is building the CPU kernels ({path.parent})")
                said = True
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"waited {timeout_s:.0f} s for another process building the CPU kernels in {path.parent} "
                    f"(lock {path}); if no other Python process of this course is running, delete {path.parent} "
                    f"and start again (LAB_CPU_KERNELS_LOCK_TIMEOUT sets the wait)") from None
            time.sleep(0.2)


def _compile():
    from torch.utils.cpp_extension import load

    build = _build_dir()
    build.mkdir(parents=True, exist_ok=True)
    lock_path = build / "build.lock"
    with open(lock_path, "w") as lock:
        if fcntl is not None:  # two processes building at once (a lab and a test) would corrupt the build
            _lock_exclusively(lock, lock_path, LOCK_TIMEOUT_S)
            # Every builder of this folder takes the flock first, and the flock dies with its holder: holding it,
            # no other builder is alive, so PyTorch's lock file here is a leftover of a killed build. PyTorch
            # would wait for it to disappear without a limit (every later start would hang silently).
            stale = build / TORCH_LOCK
            if stale.exists():
                stale.unlink()
                _say(f"lab_utils: removed the lock of an interrupted CPU-kernel build ({stale})")
        # build from copies inside the build folder: the same sources from another checkout (a CI clone, a moved
        # repo) then reuse the build instead of recompiling (ninja keys on paths)
        sources = []
        for src in SOURCES:
            copy = build / src.name
            if not copy.exists() or copy.read_bytes() != src.read_bytes():
                shutil.copyfile(src, copy)
            sources.append(str(copy))
        stamp = build / BUILT_STAMP
        first = not stamp.exists()
        if first:
            _say(f"lab_utils: compiling the CPU kernels once (about a minute; cached in {build})")
        start = time.perf_counter()
        module = load(name=NAME, sources=sources, build_directory=str(build),
                      extra_cflags=_flags(), extra_ldflags=["-fopenmp"], verbose=False)
        if first:
            stamp.write_text(f"{time.perf_counter() - start:.1f}\n")
            _say(f"lab_utils: CPU kernels compiled in {time.perf_counter() - start:.0f} s")
        return module


def switched_on(enabled: bool | None = None) -> bool:
    """`enabled` (an engine's `cpu_kernels`), or with None `EngineConfig`'s default (`LAB_CPU_KERNELS`)."""
    return cpu_switch_default("cpu_kernels") if enabled is None else enabled


def cpu_kernels(enabled: bool | None = None) -> object | None:
    """The compiled module, or None (switched off, or it could not be built: `cpu_kernels_status()` says why).
    Built once per process, on first call. `enabled`: see `switched_on`."""
    if not switched_on(enabled):
        return None
    if "module" not in _state:
        try:
            _state["module"], _state["status"] = _compile(), "compiled CPU kernels (lab_utils/engine/accel/csrc/)"
        except Exception as err:  # noqa: BLE001  (no compiler, no headers, a build error: PyTorch ops still work)
            last = str(err).strip().splitlines()[-1] if str(err).strip() else ""
            _state["module"] = None
            _state["status"] = f"PyTorch ops: the CPU kernels could not be built ({type(err).__name__}: {last})"
            warnings.warn(_state["status"] + "; the engine keeps PyTorch's ops (slower, same results)")
    return _state["module"]


def cpu_kernels_status(enabled: bool | None = None) -> str:
    """Which small-kernel path a CPU float32 engine uses, and why. `enabled`: see `switched_on`."""
    if not switched_on(enabled):
        return "PyTorch ops: LAB_CPU_KERNELS=0" if enabled is None else "PyTorch ops: cpu_kernels=False"
    cpu_kernels(True)
    return str(_state["status"])
