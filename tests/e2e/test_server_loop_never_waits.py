"""The event loop never waits on the engine: arrivals, refusals and dropped streams go through the engine
thread's inbox, so the engine lock is never taken on the loop's thread, and /health answers while a step runs."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
from _server_utils import MODEL, H, UvicornThread, tiny_engine, wait_idle

from lab_utils.server.app import create_app


class RecordingLock:
    """A threading.Lock that remembers which threads acquired it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.threads: set[int] = set()

    def acquire(self, *args, **kwargs) -> bool:
        self.threads.add(threading.get_ident())
        return self._lock.acquire(*args, **kwargs)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _stream(url: str, body: dict, keep: int | None) -> int:
    """Open a stream; read `keep` data lines then drop the connection (None: read to the end). Lines read."""
    n = 0
    with httpx.stream("POST", url + "/v1/completions", headers=H, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                n += 1
                if keep is not None and n >= keep:
                    break
    return n


def test_no_engine_lock_on_the_loop_thread_while_streams_arrive_and_drop():
    engine = tiny_engine()
    app = create_app(engine, MODEL, max_tokens_cap=64, api_key="sk-test")
    lock = app.state.async_engine._lock = RecordingLock()
    with UvicornThread(app) as srv:
        body = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(16) as pool:
            jobs = [pool.submit(_stream, srv.url, body, 2 if i % 2 else None) for i in range(16)]
            bad = pool.submit(httpx.post, srv.url + "/v1/completions", headers=H, timeout=60,
                              json={**body, "logit_bias": {"10000000": 5}})  # refused by the engine itself
            lines = [j.result() for j in jobs]
            refused = bad.result()
        assert refused.status_code == 400 and "logit_bias" in refused.text, refused.text
        assert lines[0::2] == [41] * 8 and lines[1::2] == [2] * 8  # 40 tokens + [DONE]; dropped after 2
        wait_idle(engine)
        engine.block_manager.check_all_free()  # the dropped streams were aborted, their blocks freed
        loop_thread = srv.thread.ident
        engine_thread = app.state.async_engine._thread.ident
    assert engine_thread in lock.threads, "the engine thread should hold the lock for its steps"
    assert loop_thread not in lock.threads, "the event loop's thread took the engine lock"


def test_health_and_arrivals_answer_while_a_step_is_running():
    """A step that does not end until the test says so: /health, a new request's arrival and a dropped stream
    are all handled by the loop meanwhile, and the new request is served once the step ends."""
    engine = tiny_engine()
    app = create_app(engine, MODEL, max_tokens_cap=64, api_key="sk-test")
    inside, release = threading.Event(), threading.Event()
    real_step = engine.step

    def held_step():
        if not release.is_set():
            inside.set()
            assert release.wait(60), "the test never released the step"
        return real_step()

    engine.step = held_step
    with UvicornThread(app) as srv:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(4) as pool:
            first = pool.submit(httpx.post, srv.url + "/v1/completions", headers=H, json=body, timeout=60)
            assert inside.wait(30), "the first request never reached a step"
            second = pool.submit(httpx.post, srv.url + "/v1/completions", headers=H, json=body, timeout=60)
            dropped = pool.submit(_stream, srv.url, body, 1)
            for _ in range(5):  # the loop answers while the engine thread is inside its step
                assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
            assert not release.is_set() and not first.done() and not second.done()
            release.set()
            assert first.result().status_code == 200 and second.result().status_code == 200
            assert dropped.result() == 1
        wait_idle(engine)
        engine.block_manager.check_all_free()
