"""Run LLMEngine.step() in a background thread and hand each request's tokens to an asyncio queue.

The engine is plain synchronous code; the server is async. The event loop never waits on the engine: `add` and
`abort` put a command in an inbox that the engine thread drains between steps (as vLLM's AsyncLLM hands work to
its engine core), and the engine thread alone takes the engine lock. A request's admission (or its refusal,
a ValueError said by the engine) comes back to the loop through a future, awaited without blocking anything.
A client that goes away aborts its request, which frees its KV blocks after the step that is running.

A step that raises belongs to some request, not to the server. The suspects are the requests new to the
failing step (those that did not produce a token in the step before it; all it held if none is new): a lone
suspect is ended with an error (its client gets a 500 that says why); several suspects lose their KV and go to
probation, from where they rejoin one at a time (each is cleared by its next token), so the culprit is found
alone while everyone else keeps being served. A request in three failed steps is ended too.
Only a step that fails with no request to blame, or `max_consecutive_failures` failed steps in a row, marks
the engine unusable (`error` is set: /health answers 500, new requests 503).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass

from lab_utils.engine.engine import LLMEngine
from lab_utils.engine.request import Request, RequestOutput
from lab_utils.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
MAX_STRIKES = 3  # failed steps a request may take part in before it is ended as the likely cause


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound: try again later (HTTP 503 + Retry-After)."""


class EngineDeadError(RuntimeError):
    """The engine itself failed; it serves nobody until the server restarts."""


@dataclass
class Stream:
    """One request's queue of outputs, filled by the engine thread (what `add()` returns)."""

    request_id: str
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    admitted: asyncio.Future  # None once the engine queued it; its exception if the engine refused it


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int | None = None, max_consecutive_failures: int = 8) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.max_consecutive_failures = max_consecutive_failures
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: deque[tuple] = deque()  # ("add", stream, prompt, params) | ("abort", request_id), FIFO
        self._adds_in = 0  # "add" commands put in the inbox (written by the event loop only) ...
        self._adds_out = 0  # ... and taken out (by the engine thread only): the difference counts as waiting
        self._streams: dict[str, Stream] = {}
        self._ids = itertools.count()
        self._stop = False
        self.on_output = None  # callback(RequestOutput) for metrics
        self.on_step_failure = None  # callback(number of requests ended by it) for metrics
        self.error: BaseException | None = None  # set only when the engine itself is unusable
        self.num_step_failures = 0
        self.num_failed_requests = 0
        self._consecutive_failures = 0
        self._strikes: dict[str, int] = {}
        self._probation: deque[Request] = deque()
        self._probe: Request | None = None
        self._veterans: set[str] = set()  # requests that produced a token in the last successful step
        self._thread: threading.Thread | None = None
        self._start()

    def _start(self) -> None:
        """(Re)start the loop thread: an app's shutdown stops it, and an in-process test client runs the app's
        startup/shutdown around every request."""
        if self._thread is None or not self._thread.is_alive():
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
            self._thread.start()

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + len(self._probation) + self._adds_in - self._adds_out

    def _loop(self) -> None:
        try:
            while not self._stop and self.error is None:
                self._iteration()
        except BaseException as exc:  # a bug in this loop itself: say so to every client rather than hang them
            log.exception("engine loop failed")
            self.error = exc
        if self.error is not None:
            self._fail_inbox(EngineDeadError(f"the engine failed and serves nobody until a restart: {self.error}"))
            for stream in list(self._streams.values()):
                try:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, self.error)
                except RuntimeError:  # that client's event loop is closed
                    pass
            self._streams.clear()

    def _iteration(self) -> None:
        outputs: list[RequestOutput] = []
        with self._lock:
            self._drain()
            self._admit_probe()
            busy = self.engine.has_unfinished()
            if busy:
                pending = self.engine.pending_outputs()  # step() takes these first; kept for a failure
                try:
                    outputs = self.engine.step()
                    self._consecutive_failures = 0
                    self._veterans = {o.request_id for o in outputs if o.new_token_ids and not o.finished}
                except Exception as exc:  # noqa: BLE001 - any failure is isolated, then reported
                    outputs = pending + self._isolate(exc)
        for out in outputs:
            self._deliver(out)
        if not busy:
            self._wake.wait(0.05)
            self._wake.clear()

    def _deliver(self, out: RequestOutput) -> None:
        if self._probe is not None and out.request_id == self._probe.request_id and (out.new_token_ids or out.finished):
            self._probe = None  # it ran a step of its own and produced a token: cleared
        if out.finished:
            self._strikes.pop(out.request_id, None)
        if self.on_output is not None:
            try:
                self.on_output(out)
            except Exception:  # metrics must never stop the engine
                log.exception("on_output callback failed")
        stream = self._streams.get(out.request_id)
        if stream is not None:
            if out.finished:
                self._streams.pop(out.request_id, None)
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
            except RuntimeError:  # the consumer's event loop is closed: nobody reads this request any more
                self.abort(out.request_id)

    # -- the inbox (drained by the engine thread, with the lock held) -----------------------------------
    def _drain(self) -> None:
        """Apply the adds and aborts the event loop queued since the last step, in the order they came."""
        while True:
            try:
                cmd = self._inbox.popleft()
            except IndexError:
                return
            if cmd[0] == "abort":
                self._streams.pop(cmd[1], None)
                self.engine.abort(cmd[1])
                continue
            _, stream, prompt, params = cmd
            self._adds_out += 1
            try:
                if self.error is not None:
                    raise EngineDeadError(f"the engine failed and serves nobody until a restart: {self.error}")
                self.engine.add_request(prompt, params, request_id=stream.request_id)
                self._streams[stream.request_id] = stream
                _resolve(stream, None)
            except Exception as exc:  # noqa: BLE001 - the request's refusal, said to its client
                _resolve(stream, exc)

    def _fail_inbox(self, exc: BaseException) -> None:
        """Adds that will never be drained (the loop stopped or died) are refused rather than left waiting."""
        while self._inbox:
            cmd = self._inbox.popleft()
            if cmd[0] == "add":
                self._adds_out += 1
                _resolve(cmd[1], exc)

    # -- failure isolation (called with the lock held) ---------------------------------------------
    def _isolate(self, exc: Exception) -> list[RequestOutput]:
        """A step raised: end or set aside the requests it held; return the outputs that ends them."""
        self.num_step_failures += 1
        self._consecutive_failures += 1
        held = self.engine.requests_in_step()
        suspects = [r for r in held if r.request_id not in self._veterans] or held
        log.error("engine step failed (%d suspects): %r", len(suspects), exc, exc_info=exc)
        if not suspects or self._consecutive_failures >= self.max_consecutive_failures:
            self._die(exc)
            return []
        self._veterans.difference_update(r.request_id for r in suspects)
        why = f"error: the engine failed on this request ({type(exc).__name__}: {exc})"
        ended = 0
        for req in suspects:
            strikes = self._strikes[req.request_id] = self._strikes.get(req.request_id, 0) + 1
            if len(suspects) == 1 or strikes >= MAX_STRIKES:
                self.engine.abort(req.request_id, reason=why)
                ended += 1
            else:
                self.engine.set_aside(req.request_id)
                self._probation.append(req)
            if self._probe is req:
                self._probe = None
        self.num_failed_requests += ended
        if self.on_step_failure is not None:
            self.on_step_failure(ended)
        return self.engine.take_pending_outputs()

    def _admit_probe(self) -> None:
        """Let the next request on probation rejoin the scheduler once the previous one is cleared."""
        if self._probe is not None and self._probe.status.done:
            self._probe = None
        while self._probe is None and self._probation:
            req = self._probation.popleft()
            if self.engine.resume(req.request_id):  # False: its client left meanwhile
                self._probe = req

    def _die(self, exc: BaseException) -> None:
        self.error = exc
        for rid in list(self._streams):
            self.engine.abort(rid, reason=f"error: the engine failed ({type(exc).__name__}: {exc})")

    # -- the async side ------------------------------------------------------------------------------
    def add(self, prompt: str | list[int], params: SamplingParams) -> Stream:
        """Hand a request to the engine thread (call from the event loop; never waits); returns its stream for
        `outputs()`. Raises QueueFullError or EngineDeadError at once; the engine's own refusal (ValueError)
        comes from `await admitted(stream)` (or from `outputs()`), still before anything is sent."""
        if self.error is not None:
            raise EngineDeadError(f"the engine failed and serves nobody until a restart: {self.error}")
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise QueueFullError(f"{self.num_waiting} requests are already waiting (max_waiting="
                                 f"{self.max_waiting}); retry later")
        loop = asyncio.get_running_loop()
        stream = Stream(f"req-{next(self._ids)}", asyncio.Queue(), loop, loop.create_future())
        self._adds_in += 1
        self._inbox.append(("add", stream, prompt, params))
        self._start()
        self._wake.set()
        return stream

    async def admitted(self, stream: Stream) -> None:
        """Wait (without blocking the loop) until the engine thread queued the request; raise its refusal."""
        try:
            await asyncio.shield(stream.admitted)
        except asyncio.CancelledError:  # its client left before the engine took it: dropped right after
            self.abort(stream.request_id)
            raise

    async def outputs(self, stream: Stream, abort_on_exit: bool = True):
        """Async iterator of RequestOutput for a request from `add()`; aborts it if the consumer stops early
        (unless `abort_on_exit` is False: then the consumer does, as the streaming loop `stream_sse`)."""
        finished = False
        try:
            await self.admitted(stream)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine failed: {item}") from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished and abort_on_exit:
                self.abort(stream.request_id)

    async def generate(self, prompt: str | list[int], params: SamplingParams):
        """add() + outputs() in one async iterator."""
        async for out in self.outputs(self.add(prompt, params)):
            yield out

    def abort(self, request_id: str) -> None:
        """Stop a request (its client left): done by the engine thread before its next step; never waits."""
        self._inbox.append(("abort", request_id))
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._fail_inbox(EngineDeadError("the server is shutting down"))


def _resolve(stream: Stream, exc: BaseException | None) -> None:
    """Settle a stream's admission from the engine thread (its loop may be closed: nobody waits then)."""
    def settle() -> None:
        if not stream.admitted.done():
            stream.admitted.set_result(None) if exc is None else stream.admitted.set_exception(exc)
    try:
        stream.loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass
