"""A client's expensive work, off the event loop: compiling its schema and tokenising its long text.

The event loop serves every connection (/health, every stream's next chunk); a 9-second grammar compilation or
a 1 MB prompt's tokenisation on it would freeze them all. The grammar library holds Python's lock for much of
a compilation (a thread would still starve the loop), so schemas compile in worker *processes*: the server
only waits for the result (the compiled grammar, serialised) in a thread. Long texts are tokenised in a thread
(the Rust tokenizer releases the lock while it works).

A compilation that takes longer than `compile_timeout_s` is refused ("schema too complex", a 400) and its
worker process is killed, so it costs nothing afterwards; the refusal is cached like a grammar. At most
`compile_workers` compilations run at once; a request waits for a free worker up to the same time limit, then
gets a 503 with Retry-After (the compiler is busy): never an unbounded queue.

Nothing outlives the server: the app's shutdown kills the workers, and each worker also watches its parent, so
a server killed outright (SIGKILL, or a signal that ends it before its shutdown runs) takes them with it: on
Linux the kernel sends the worker SIGKILL as its parent goes (`PR_SET_PDEATHSIG`), and everywhere a thread in
the worker exits it once its parent process is gone. multiprocessing's resource tracker ends by itself when
the last process holding its pipe (the server, the workers) is gone.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

from lab_utils.structured.hook import CompileTimeout, build_grammar
from lab_utils.structured.params import StructuredOutputParams

COMPILE_TIMEOUT_S = 10.0
PARENT_POLL_S = 0.25  # how often a worker checks that the server is still its parent
PR_SET_PDEATHSIG = 1  # linux/prctl.h
TOKENIZE_INLINE_CHARS = 20_000  # shorter text is tokenised on the loop (well under a millisecond per kB)

_worker_compiler = None  # in a worker process: its xgrammar GrammarCompiler


def _die_with_parent(parent_pid: int) -> None:
    """End this worker when the server that started it ends, however it ends (called first in the worker)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # sent when the parent (its thread) exits
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # it went before the line above took effect
        os._exit(0)

    def watch() -> None:  # the portable half, and a second line should the kernel's signal not come
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _worker_init(tokenizer_info_json: str, parent_pid: int | None = None) -> None:
    global _worker_compiler
    if parent_pid is not None:
        _die_with_parent(parent_pid)
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    _worker_compiler = xgr.GrammarCompiler(info, cache_enabled=False)


def _worker_build(so: StructuredOutputParams) -> str:
    return build_grammar(_worker_compiler, so).serialize_json()


def _ready() -> bool:
    return True


class SchemaTooComplex(CompileTimeout):
    """The grammar did not compile within the time limit."""


class CompilerBusy(RuntimeError):
    """Every compile worker is taken: retry later."""


class Offload:
    def __init__(self, engine, compile_timeout_s: float = COMPILE_TIMEOUT_S, compile_workers: int = 2) -> None:
        self.engine = engine
        self.compile_timeout_s = compile_timeout_s
        self.compile_workers = compile_workers
        self._threads = ThreadPoolExecutor(compile_workers, thread_name_prefix="schema-compile")
        self._text_pool = ThreadPoolExecutor(2, thread_name_prefix="tokenize")
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="compile-start")
        self._procs: ProcessPoolExecutor | None = None
        self._busy = 0
        self._lock = threading.Lock()

    # -- schemas ---------------------------------------------------------------------------------------
    async def compile(self, so) -> None:
        """Compile `so` (structured-output params or None) into the engine's cache, so `add_request` finds it.
        Raises ValueError (bad or unsatisfiable schema), SchemaTooComplex or CompilerBusy."""
        so = StructuredOutputParams.coerce(so)
        if so is None:
            return
        structured = self.engine.structured
        loop = asyncio.get_running_loop()
        if structured.answers_at_once(so):
            structured.compile(so)  # at once: compiled (or refused) before
            return
        # the tokenizer's table and the worker processes, once per server: not the client's time
        await loop.run_in_executor(self._starter, self._pool)
        await self._take_worker()
        try:
            await loop.run_in_executor(self._threads, lambda: structured.compiler.compile(so, build=self._build))
        finally:
            with self._lock:
                self._busy -= 1

    async def _take_worker(self) -> None:
        """Wait (up to the compile time limit) for a free compile worker; then it is this request's."""
        deadline = time.monotonic() + self.compile_timeout_s
        while True:
            with self._lock:
                if self._busy < self.compile_workers:
                    self._busy += 1
                    return
            if time.monotonic() > deadline:
                raise CompilerBusy(f"{self._busy} schemas are being compiled (the most at once) and none finished "
                                   f"within {self.compile_timeout_s:g} s; retry shortly")
            await asyncio.sleep(0.02)

    def _pool(self) -> ProcessPoolExecutor:
        """The worker processes, started (and waited for) outside any request's time limit."""
        with self._lock:
            if self._procs is None:
                info = self.engine.structured.compiler.info.serialize_json()
                self._procs = ProcessPoolExecutor(self.compile_workers, multiprocessing.get_context("spawn"),
                                                  initializer=_worker_init, initargs=(info, os.getpid()))
                procs = self._procs
            else:
                return self._procs
        for f in [procs.submit(_ready) for _ in range(self.compile_workers)]:
            f.result()
        return procs

    def _build(self, so: StructuredOutputParams):
        """Compile in a worker process within the time limit (a worker thread waits here, off the loop)."""
        xgr = self.engine.structured.compiler.xgr
        for attempt in range(2):  # a pool broken by another request's timeout is restarted once
            pool = self._pool()
            future = pool.submit(_worker_build, so)
            try:
                text = future.result(timeout=self.compile_timeout_s)
                break
            except FutureTimeout:
                self._kill(pool)
                raise SchemaTooComplex(f"schema too complex: compiling it took more than {self.compile_timeout_s:g} "
                                       f"s (long maxLength / maxItems bounds and deep nesting cost the most); "
                                       f"simplify it") from None
            except BrokenProcessPool:
                self._kill(pool)
                if attempt:
                    raise
        return xgr.CompiledGrammar.deserialize_json(text, self.engine.structured.compiler.info)

    def _kill(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._procs is pool:
                self._procs = None
        for p in list((getattr(pool, "_processes", None) or {}).values()):
            p.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    # -- text ------------------------------------------------------------------------------------------
    async def run(self, fn, *args, size: int = 0):
        """fn(*args), in a worker thread when the input is large (`size` characters), else here."""
        if size < TOKENIZE_INLINE_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._text_pool, fn, *args)

    def shutdown(self) -> None:
        """Kill the compile workers (the app's shutdown calls this); the next compilation starts new ones."""
        procs = self._procs
        if procs is not None:
            workers = list((getattr(procs, "_processes", None) or {}).values())
            self._kill(procs)
            for p in workers:
                p.join(timeout=5)
