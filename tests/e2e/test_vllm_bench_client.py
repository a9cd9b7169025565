"""vLLM's own benchmark client (`vllm bench serve`) measures the lab server, as it would measure vLLM's."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from lab_utils import vllm_env
from lab_utils.models.loader import model_folder
from lab_utils.server.process import LabServer


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_bench_serve_against_the_lab_server(tmp_path):
    ok, why = vllm_env.available()
    if not ok:
        pytest.skip(why)
    with LabServer("tiny-random", device="cpu", max_num_seqs=8) as srv:
        cmd = [sys.executable, "-m", "lab_utils.vllm_cli", "bench", "serve", "--backend", "openai",
               "--base-url", srv.base_url, "--endpoint", "/v1/completions", "--model", "tiny-random",
               "--tokenizer", str(model_folder("smollm2-135m")), "--dataset-name", "random",
               "--random-input-len", "16", "--random-output-len", "8", "--num-prompts", "8", "--ignore-eos",
               "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
        metrics = httpx.get(srv.base_url + "/metrics", timeout=10).text
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 8 and result.get("failed", 0) == 0
    # vLLM's client counts output tokens by re-tokenizing the streamed text (random-model text re-tokenizes to
    # about, not exactly, 64); the server's own counter: at least 8 x 8 (the client also sends a warm-up request)
    generated = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("lab:generation_tokens_total"))
    assert generated >= 8 * 8 and result["total_output_tokens"] > 0
    assert result["mean_ttft_ms"] > 0 and result["output_throughput"] > 0
