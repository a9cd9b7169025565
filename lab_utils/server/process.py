"""OpenAI-compatible servers as child processes (the lab's and vLLM's), for notebooks, tests and benchmarks.

Each runs in its own process group on 127.0.0.1; `start()` waits for `/health` within a time limit and shows
the log's tail if it fails; `stop()` ends the whole group and waits, and runs at exit too, so a notebook that
fails half-way leaves no server behind.
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_flags(flags: dict) -> list[str]:
    """{"max_num_seqs": 8, "enable_prefix_caching": False} -> ["--max-num-seqs", "8", "--no-enable-prefix-caching"]."""
    out: list[str] = []
    for k, v in flags.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + k.replace("_", "-"))
        elif v is not None:
            out += [flag, str(v)]
    return out


class ServerProcess:
    """A server started as `python -m <module> ... --host 127.0.0.1 --port P`, healthy when `/health` says 200."""

    name = "server"

    def __init__(self, module_args: list[str], port: int | None = None, startup_timeout_s: float = 120.0,
                 env: dict[str, str] | None = None, log_path: str | None = None) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        self.cmd = [sys.executable, "-m", *module_args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.env = dict(os.environ, **(env or {}))
        self.log_path = log_path or tempfile.NamedTemporaryFile(prefix=f"{self.name}_", suffix=".log", delete=False).name
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> "ServerProcess":
        import httpx

        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        atexit.register(self.stop)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.name} not healthy after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the process group, SIGKILL after `grace_s`, then wait until every member is gone."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:  # children that outlived the leader (same group)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.2)
        if self._log:
            self._log.close()
            self._log = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LabServer(ServerProcess):
    """`python -m lab_utils serve`: `with LabServer("smollm2-135m", max_num_seqs=32) as srv: ... srv.base_url`.
    Engine flags are keyword arguments with the engine's names (`max_num_seqs=32` -> `--max-num-seqs 32`);
    `learner_parts=["server.stream_sse"]` runs the learner's streaming loop (saved in my_engine/);
    `learner_upto="12"` runs the engine with the learner's saved parts of labs up to 12 (the reference elsewhere);
    `extra_models=["smollm2-draft"]` serves those models too, each on its own engine, picked by a request's `model`."""

    name = "lab_server"

    def __init__(self, model: str = "smollm2-135m", port: int | None = None, device: str = "auto",
                 api_key: str | None = None, startup_timeout_s: float = 120.0, learner_parts=(),
                 learner_upto: str | None = None, extra_models=(), **engine_flags) -> None:
        args = ["lab_utils", "serve", "--model", model, "--device", device, *cli_flags(engine_flags)]
        for extra in extra_models:
            args += ["--extra-model", extra]
        if api_key:
            args += ["--api-key", api_key]
        env = {"HF_HUB_OFFLINE": "1"}
        if learner_parts or learner_upto:  # the server loads the learner's saved parts from this process's my_engine/
            from lab_utils.course.learner_parts import learner_dir

            if learner_parts:
                args += ["--learner-parts", *learner_parts]
            if learner_upto:
                args += ["--learner-upto", learner_upto]
            env["LAB_LEARNER_DIR"] = str(learner_dir().resolve())
        super().__init__(args, port, startup_timeout_s, env=env)
