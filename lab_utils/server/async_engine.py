"""Run LLMEngine.step() in a background thread and hand each request's tokens to an asyncio queue.

The engine is plain synchronous code; the server is async. One lock serialises them: the loop thread holds it
for one step at a time, and add/abort take it between steps. A client that goes away aborts its request, which
frees its KV blocks at once.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import dataclass

from lab_utils.engine.engine import LLMEngine
from lab_utils.engine.request import RequestOutput
from lab_utils.engine.sampling_params import SamplingParams


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stop = False
        self.on_output = None  # callback(RequestOutput) for metrics
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop:
            with self._lock:
                busy = self.engine.has_unfinished()
                outputs = []
                if busy:
                    try:
                        outputs = self.engine.step()
                    except BaseException as exc:  # fail every waiting client loudly rather than hang them
                        self.error = exc
                        outputs = []
                        for rid in list(self._streams):
                            self.engine.abort(rid)
            for out in outputs:
                if self.on_output is not None:
                    self.on_output(out)
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
            if self.error is not None:
                for rid, stream in list(self._streams.items()):
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, self.error)
                self._streams.clear()
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

    async def generate(self, prompt: str | list[int], params: SamplingParams):
        """Async iterator of RequestOutput for one request; aborts it if the consumer stops early."""
        rid = f"req-{next(self._ids)}"
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop())
        self._streams[rid] = stream
        with self._lock:
            self.engine.add_request(prompt, params, request_id=rid)
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise RuntimeError(f"engine failed: {item}") from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        with self._lock:
            self.engine.abort(request_id)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
