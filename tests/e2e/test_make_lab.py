"""`make lab` (the README's first command) writes the learner copies into student/ and starts JupyterLab on them,
on localhost: it answers and serves a learner copy (solutions stripped), then we stop it."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.notebooks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "python").exists(), reason="needs the project's .venv (make setup)")
def test_make_lab_serves_jupyterlab(tmp_path):
    port, token = _free_port(), secrets.token_hex(8)
    args = f"--no-browser --port={port} --ServerApp.ip=127.0.0.1 --IdentityProvider.token={token}"
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"), JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"))
    proc = subprocess.Popen(["make", "-C", str(REPO), "lab", f"LAB_ARGS={args}"], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline, answered = time.time() + 300, False  # setup is already done; prepare is idempotent
        while time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2) as r:
                    answered = r.status == 200
                    break
            except OSError:
                time.sleep(1)
        if not answered:
            out = proc.stdout.read().decode(errors="replace") if proc.poll() is not None else "(still running)"
            pytest.fail(f"make lab did not serve JupyterLab on port {port}: {out[-2000:]}")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents/?token={token}", timeout=10) as r:
            names = {item["name"] for item in json.load(r)["content"]}
        assert "00_foundations.ipynb" in names, f"JupyterLab should open on the learner copies (student/): {names}"
        url = f"http://127.0.0.1:{port}/api/contents/00_foundations.ipynb?token={token}"
        with urllib.request.urlopen(url, timeout=10) as r:
            cells = json.load(r)["content"]["cells"]
        sources = "\n".join(c["source"] for c in cells)
        assert "### BEGIN SOLUTION" not in sources, "make lab serves the solved notebook, not the learner copy"
        assert any("exercise" in c["metadata"].get("tags", []) for c in cells), "no exercise cell in the copy"
        assert (REPO / "student" / "00_foundations.ipynb").exists()
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=20)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
    assert proc.poll() is not None, "make lab is still running after the test"
