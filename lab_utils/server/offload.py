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
"""
from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

from lab_utils.structured.hook import CompileTimeout, build_grammar
from lab_utils.structured.params import StructuredOutputParams

COMPILE_TIMEOUT_S = 10.0
TOKENIZE_INLINE_CHARS = 20_000  # shorter text is tokenised on the loop (well under a millisecond per kB)

_worker_compiler = None  # in a worker process: its xgrammar GrammarCompiler


def _worker_init(tokenizer_info_json: str) -> None:
    global _worker_compiler
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
                                                  initializer=_worker_init, initargs=(info,))
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
        if self._procs is not None:
            self._kill(self._procs)
