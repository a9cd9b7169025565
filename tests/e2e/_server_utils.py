"""Helpers shared by the server tests: an in-process uvicorn on 127.0.0.1, a tiny engine, waiting until idle."""
from __future__ import annotations

import socket
import threading
import time

import torch

MODEL = "tiny-random"
KEY = "sk-test"
H = {"Authorization": f"Bearer {KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class UvicornThread:
    """`with UvicornThread(app) as srv: httpx.get(srv.url + ...)`: loopback only, stops on exit."""

    def __init__(self, app, port: int | None = None, **config) -> None:
        import uvicorn

        port = port or free_port()
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start in 30 s"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.app.state.async_engine.shutdown()


def tiny_engine(**config):
    from lab_utils import EngineConfig, LLMEngine, load_model

    model, tok = load_model(MODEL, device="cpu", dtype=torch.float32)
    cfg = dict(max_num_seqs=64, max_num_batched_tokens=512)
    cfg.update(config)
    return LLMEngine((model, tok), EngineConfig(**cfg), device="cpu")


def wait_idle(engine, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while engine.scheduler.has_work():
        assert time.time() < deadline, f"engine still busy: {engine.stats()}"
        time.sleep(0.05)
