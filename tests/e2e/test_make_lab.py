"""`make lab` (the README's first command) starts JupyterLab on localhost: it answers, then we stop it."""
from __future__ import annotations

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
            assert b"00_foundations" in r.read(), "JupyterLab should open on labs/"
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
