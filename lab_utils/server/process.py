"""The lab server as a child process (for notebooks, tests and benchmarks), stopped with its whole group."""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import time

from lab_utils.vllm_env import free_port


class LabServer:
    """`with LabServer("smollm2-135m", max_num_seqs=32) as srv: ... srv.base_url ...`

    Engine flags are passed as keyword arguments with the engine's names (`max_num_seqs=32` ->
    `--max-num-seqs 32`; booleans as `--flag` / `--no-flag`)."""

    def __init__(self, model: str = "smollm2-135m", port: int | None = None, device: str = "auto",
                 api_key: str | None = None, startup_timeout_s: float = 120.0, **engine_flags) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key, self.startup_timeout_s = api_key, startup_timeout_s
        self.args = [sys.executable, "-m", "lab_utils", "serve", "--model", model, "--host", "127.0.0.1",
                     "--port", str(self.port), "--device", device]
        if api_key:
            self.args += ["--api-key", api_key]
        for k, v in engine_flags.items():
            flag = "--" + k.replace("_", "-")
            if isinstance(v, bool):
                self.args.append(flag if v else "--no-" + k.replace("_", "-"))
            else:
                self.args += [flag, str(v)]
        self.log_path = tempfile.NamedTemporaryFile(prefix="lab_server_", suffix=".log", delete=False).name
        self.proc: subprocess.Popen | None = None

    def start(self) -> "LabServer":
        import httpx

        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, HF_HUB_OFFLINE="1"))
        atexit.register(self.stop)  # a notebook that fails half-way must not leave a server behind
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the lab server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the lab server did not answer within {self.startup_timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return open(self.log_path).read()[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> "LabServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
