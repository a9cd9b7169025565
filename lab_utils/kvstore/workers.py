"""Prefill workers in processes of their own, sharing one KV store (Mooncake's layout for the prefill side).

Each worker is an `LLMEngine` with the store under its prefix cache (`tier.attach(..., publish=True)`): the
blocks of every prompt it computes go to the store, and a prompt whose prefix another worker computed is read
from the store instead of being computed again. So a router may send a returning conversation to any worker,
not only the one that served its earlier turns. With `use_store=False` the same workers share nothing: the
baseline where only the worker that holds a prefix can reuse it.

    with PrefillWorkers("smollm2-135m", EngineConfig(enable_prefix_caching=True), n=2) as pool:
        pool.prefill(0, turn_1_ids)            # worker 0 computes it, and publishes its blocks
        pool.prefill(1, turn_1_ids + turn_2)   # worker 1 reads turn 1's blocks from the store
"""
from __future__ import annotations

import time

import torch

from lab_utils.engine.config import EngineConfig
from lab_utils.engine.sampling_params import SamplingParams
from lab_utils.kvstore.store import KVStoreClient, KVStoreProcess


def _worker_main(model: str, config: EngineConfig, dtype: str, client: KVStoreClient | None, conn) -> None:
    """One prefill worker: build the engine, then serve ("prefill", token ids) until ("stop",) or EOF."""
    from lab_utils.engine.engine import LLMEngine
    from lab_utils.kvstore.returning import leak_report
    from lab_utils.kvstore.tier import attach
    from lab_utils.parallel.runner import load_weights_only

    torch.set_num_threads(1)
    try:
        # token ids only (no tokenizer: importing transformers costs a worker seconds of start-up)
        engine = LLMEngine((load_weights_only(model, torch.device("cpu"), getattr(torch, dtype)), None), config,
                           device="cpu")
        engine.keep_history = False  # a worker lives as long as its pool: forget ended requests
        tier = attach(engine, client, publish=True) if client is not None else None
        conn.send(("ready",))
    except Exception as e:  # the parent raises it with the worker's message
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    params = SamplingParams(max_tokens=1, temperature=0.0)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "stop":
            return
        t = time.perf_counter()
        out = engine.generate([msg[1]], params)[0]
        result = {"first_token": out.token_ids[0], "num_cached_tokens": out.num_cached_tokens,
                  "prompt_tokens": len(msg[1]), "seconds": time.perf_counter() - t}
        if tier is not None:
            s = tier.client.stats
            result.update(store_bytes_in=s.get_bytes, store_bytes_out=s.put_bytes, store_seconds=s.seconds,
                          blocks_from_store=tier.blocks_in, blocks_to_store=tier.blocks_out)
        result["leaked"] = leak_report(engine)  # '' when every block came back once the request ended
        conn.send(("done", result))


class PrefillWorkers:
    """`n` prefill workers (processes), sharing one KV store of `store_bytes` unless `use_store` is False; or
    `store`, a `KVStoreProcess` already running (a disaggregated cluster's, another pool's) that its owner stops."""

    def __init__(self, model: str, config: EngineConfig, n: int = 2, store_bytes: int = 256 << 20,
                 use_store: bool = True, dtype: str = "float32", startup_timeout_s: float = 300.0,
                 store: KVStoreProcess | None = None) -> None:
        if n < 1:
            raise ValueError(f"n={n}: give at least one worker")
        if not config.enable_prefix_caching:
            raise ValueError("prefill workers share blocks through the prefix cache: enable_prefix_caching=True")
        if store is not None and not use_store:
            raise ValueError("store is the pool's shared store: it needs use_store=True")
        ctx = torch.multiprocessing.get_context("spawn")
        self._owns_store = use_store and store is None
        self.store = store if store is not None else KVStoreProcess(store_bytes) if use_store else None
        self._conns, self._procs = [], []
        try:
            for i in range(n):
                parent, child = ctx.Pipe()
                client = self.store.client() if self.store is not None else None
                p = ctx.Process(target=_worker_main, args=(model, config, dtype, client, child), daemon=True,
                                name=f"lab-prefill-{i}")
                p.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(p)
            for i, conn in enumerate(self._conns):
                if not conn.poll(startup_timeout_s):
                    raise TimeoutError(f"prefill worker {i} did not start within {startup_timeout_s} s")
                msg = conn.recv()
                if msg[0] == "error":
                    raise RuntimeError(f"prefill worker {i} failed to start: {msg[1]}")
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self._conns)

    def prefill(self, worker: int, token_ids: list[int], timeout_s: float = 300.0) -> dict:
        """Run one prompt's prefill on `worker`: its first token, the prompt tokens it did not compute
        (`num_cached_tokens`), the seconds it took there, and the store traffic of that worker so far."""
        conn = self._conns[worker]
        conn.send(("prefill", list(token_ids)))
        if not conn.poll(timeout_s):
            raise TimeoutError(f"prefill worker {worker} gave no answer within {timeout_s} s")
        kind, result = conn.recv()
        if kind != "done":
            raise RuntimeError(f"prefill worker {worker} answered {kind!r}: {result}")
        return result

    def close(self) -> None:
        """Stop the workers and the store the pool started: no process outlives the pool."""
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        if self.store is not None and self._owns_store:
            self.store.close()

    def __enter__(self) -> "PrefillWorkers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
