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
  INT8 weights with INT8 activations (`"w8a8"`: byte dot products, no widening of the weights to float).

They are compiled on first use by `torch.utils.cpp_extension` (g++ and ninja; ~30-40 s once, then cached in
`cache_dir()/torch_extensions`). Where that fails (no compiler) the engine warns once and keeps the PyTorch
ops (and oneDNN for the linears), which compute the same thing: `cpu_kernels_status()` says which is in use.
`LAB_CPU_KERNELS=0` turns the kernels off (A/B measurements).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # Windows: no file locks (and rarely a compiler torch can use)
    fcntl = None

from lab_utils.paths import cache_dir

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in
           ("paged_decode_attention.cpp", "layer_ops.cpp", "small_m_linear.cpp", "bindings.cpp")]
# -fopenmp: ATen's parallel_for is OpenMP code inlined from its header; the extension then shares torch's own
# libgomp (same soname, already loaded). -ffast-math lets exp vectorise (softmax, silu).
_ISA = {"AVX2": ["-mavx2", "-mfma"], "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"]}
_state: dict[str, object] = {}


def _flags() -> list[str]:
    return ["-O3", "-ffast-math", "-fopenmp", *_ISA.get(torch.backends.cpu.get_cpu_capability(), [])]


def _build_dir() -> Path:
    """One folder per sources, flags, torch version and CPU capability: a changed kernel or another CPU rebuilds."""
    capability = torch.backends.cpu.get_cpu_capability()  # e.g. AVX2, AVX512, DEFAULT
    digest = hashlib.sha256(" ".join(_flags()).encode() + torch.__version__.encode())
    for src in SOURCES:
        digest.update(src.read_bytes())
    return cache_dir() / "torch_extensions" / f"lab_cpu_kernels-{capability.lower()}-{digest.hexdigest()[:12]}"


def _compile():
    from torch.utils.cpp_extension import load

    build = _build_dir()
    build.mkdir(parents=True, exist_ok=True)
    with open(build / "build.lock", "w") as lock:
        if fcntl is not None:  # two processes building at once (a lab and a test) would corrupt the build
            fcntl.flock(lock, fcntl.LOCK_EX)
        # build from copies inside the build folder: the same sources from another checkout (a CI clone, a moved
        # repo) then reuse the build instead of recompiling (ninja keys on paths)
        sources = []
        for src in SOURCES:
            copy = build / src.name
            if not copy.exists() or copy.read_bytes() != src.read_bytes():
                shutil.copyfile(src, copy)
            sources.append(str(copy))
        return load(name="lab_cpu_kernels", sources=sources, build_directory=str(build),
                    extra_cflags=_flags(), extra_ldflags=["-fopenmp"], verbose=False)


def switched_off() -> bool:
    return os.environ.get("LAB_CPU_KERNELS", "1") == "0"


def cpu_kernels() -> object | None:
    """The compiled module, or None (switched off, or it could not be built: `cpu_kernels_status()` says why).
    Built once per process, on first call."""
    if switched_off():
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


def cpu_kernels_status() -> str:
    """Which small-kernel path a CPU float32 engine uses, and why."""
    if switched_off():
        return "PyTorch ops: LAB_CPU_KERNELS=0"
    cpu_kernels()
    return str(_state["status"])
