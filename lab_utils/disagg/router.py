"""The router of a disaggregated deployment, and the colocated baseline it is compared with.

`DisaggregatedCluster` starts a prefill worker and a decode worker (spawned processes, see `workers.py`), sends
each request to the prefill worker when it arrives, and collects finished requests from both. It watches the
workers: if one dies (killed, crashed), every request it held is either re-queued on fresh workers
(`on_worker_failure="requeue"`: re-prefilled from scratch, greedy outputs unchanged) or finished with an
`error: ...` reason (`"fail"`); never silently lost. Every process is stopped on `close()` / `__exit__`.
With `kv_transfer="store"` the prompts' full KV blocks go through a shared KV store process (Mooncake's layout,
`store_handoff.py`) instead of the pipe between the workers; the store outlives a restart of the workers.

`colocated_run` is the same workload on one `LLMEngine` in this process: prefill and decode share every step.
"""
from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait

import torch

from lab_utils.device import now
from lab_utils.disagg.workers import DTYPES, decode_main, prefill_main
from lab_utils.engine.config import EngineConfig
from lab_utils.engine.request import RequestMetrics, RequestOutput
from lab_utils.engine.sampling_params import SamplingParams
from lab_utils.parallel.launch import stop_processes

FAILURE_POLICIES = ("requeue", "fail")
KV_TRANSFERS = ("pipe", "store")  # the prompt's KV on the pipe between the workers, or its full blocks via a store
_RUNS = itertools.count()  # request ids of `colocated_run` stay unique when one engine serves several runs


def load_tokenizer_for(model: str):
    """The tokenizer that goes with a model name or folder (random-weight models borrow SmolLM2's)."""
    from lab_utils.models.loader import model_folder
    from lab_utils.models.registry import lookup
    from lab_utils.models.tokenizer import load_tokenizer

    spec, _ = lookup(str(model))
    return load_tokenizer(model_folder(spec.tokenizer_from if spec and spec.kind == "random" else str(model)))


def _requests(tokenizer, prompts, params, arrival_times) -> list[tuple[str | None, list[int], SamplingParams, float]]:
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
    arr = list(arrival_times) if arrival_times is not None else [0.0] * len(prompts)
    if len(plist) != len(prompts) or len(arr) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts, {len(plist)} SamplingParams and {len(arr)} arrival_times; "
                         f"give one of each per prompt")
    if any(a < 0 for a in arr):
        raise ValueError(f"arrival_times must be >= 0 seconds from the start, got {min(arr)}")
    out = []
    for p, sp, a in zip(prompts, plist, arr):
        ids = tokenizer(p, add_special_tokens=False).input_ids if isinstance(p, str) else [int(t) for t in p]
        if not ids:
            raise ValueError("a prompt is empty: give at least one token")
        out.append((p if isinstance(p, str) else None, ids, sp, float(a)))
    return out


def _text(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True) if tokenizer is not None else ""


def colocated_run(model, engine_config: EngineConfig | None, prompts, params: SamplingParams | list | None = None,
                  arrival_times=None, device: str = "cpu", dtype: str = "float32",
                  threads: int = 1) -> list[RequestOutput]:
    """The baseline: one `LLMEngine` in this process serves the workload (requests join at their arrival times)."""
    from lab_utils.engine.engine import LLMEngine

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if isinstance(model, LLMEngine):
            engine = model
        else:
            engine = LLMEngine(model, engine_config, device=device, dtype=DTYPES[dtype])
        reqs = _requests(engine.tokenizer, prompts, params, arrival_times)
        order = sorted(range(len(reqs)), key=lambda i: reqs[i][3])
        run = next(_RUNS)
        ids = [f"c{run}-{i}" for i in range(len(reqs))]
        done: dict[str, RequestOutput] = {}
        t0 = now()
        while len(done) < len(reqs):
            while order and t0 + reqs[order[0]][3] <= now():
                i = order.pop(0)
                text, toks, sp, a = reqs[i]
                engine.add_request(text if text is not None else toks, sp, request_id=ids[i], arrival_time=t0 + a)
            if engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
            elif order:
                time.sleep(max(0.0, t0 + reqs[order[0]][3] - now()))
        return [done[i] for i in ids]
    finally:
        torch.set_num_threads(old)


def _shared_gpu_share(config: EngineConfig, share: float | None) -> EngineConfig:
    """Two workers on one GPU: each sized from its own share of the card (unless its KV is sized explicitly)."""
    import dataclasses

    if share is None or config.kv_cache_memory_bytes is not None or config.num_gpu_blocks is not None:
        return config
    return dataclasses.replace(config, gpu_memory_utilization=min(config.gpu_memory_utilization, share))


@dataclass
class _Tracked:
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams
    arrival: float  # absolute, monotonic clock
    state: str = "pending"  # pending -> prefill -> decode -> done
    output: RequestOutput | None = None


@dataclass
class WorkerFailure:
    worker: str
    exitcode: int | None
    requests: list[str] = field(default_factory=list)
    action: str = "requeue"


class DisaggregatedCluster:
    """A prefill worker + a decode worker + this router. Use as a context manager."""

    def __init__(self, model: str = "smollm2-135m", engine_config: EngineConfig | None = None, device: str = "cpu",
                 dtype: str | None = None, prefill_config: EngineConfig | None = None,
                 decode_config: EngineConfig | None = None, on_worker_failure: str = "requeue",
                 threads_per_worker: int = 1, startup_timeout_s: float = 300.0, learner_parts=(),
                 audit_kv: bool = False, engine_parts_upto: str | None = None, kv_transfer: str = "pipe",
                 kv_store_bytes: int = 256 << 20, kv_store=None) -> None:
        """`learner_parts`: names of the learner's KV hand-off parts (disagg.export_kv, import_kv,
        resume_prefilled) the workers load from my_engine/ in place of the reference. `engine_parts_upto`
        ("09"): both workers' engines also run every engine part the learner saved in labs up to that one
        (`learner_parts.parts(upto=...)`: scheduler, block manager, ...), the reference for the rest. `audit_kv`: both workers
        fingerprint every handed-off request's KV blocks (`kv_handoff_check`); it costs a hash of the KV, so the
        throughput runs leave it off. `kv_transfer`: "pipe" (the whole prompt KV from worker to worker) or
        "store" (its full blocks through a KV store: a `KVStoreProcess` of `kv_store_bytes` that the cluster
        starts and stops, or `kv_store`, one already running that other clusters or workers share and that its
        owner stops)."""
        if on_worker_failure not in FAILURE_POLICIES:
            raise ValueError(f"on_worker_failure={on_worker_failure!r} is invalid: must be one of {FAILURE_POLICIES}")
        if kv_transfer not in KV_TRANSFERS:
            raise ValueError(f"kv_transfer={kv_transfer!r} is invalid: must be one of {KV_TRANSFERS}")
        if kv_store is not None and kv_transfer != "store":
            raise ValueError("kv_store is the store of kv_transfer='store'; pass both or neither")
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device={device!r} is invalid: must be 'auto', 'cpu' or 'cuda'")
        from lab_utils.parallel.placement import pd_placement

        # prefill on cuda:0 and decode on cuda:1 where there are two GPUs; one shared GPU is split explicitly
        self.placement = pd_placement(device)
        on_gpu = self.placement.prefill != "cpu"
        dtype = dtype or ("bfloat16" if on_gpu else "float32")  # the engine's defaults on each device
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is invalid: must be one of {tuple(DTYPES)}")
        base = engine_config or EngineConfig()
        self.model, self.device, self.dtype = str(model), "cuda" if on_gpu else "cpu", dtype
        self.prefill_config, self.decode_config = (_shared_gpu_share(c or base, self.placement.gpu_memory_utilization)
                                                   for c in (prefill_config, decode_config))
        self.on_worker_failure, self.threads, self.startup_timeout_s = on_worker_failure, threads_per_worker, startup_timeout_s
        self.tokenizer = None
        self._procs: dict[str, object] = {}
        self._conns: dict[str, object] = {}
        self._records: dict[str, dict] = {}  # request id -> transfer record (prefill + decode halves)
        self.failures: list[WorkerFailure] = []
        self.num_requeued = 0
        self._batches = 0
        self._healthy = False
        self.learner_parts = tuple(learner_parts)
        self.learner_parts_ran: dict[str, list[str]] = {}  # worker -> the learner's parts it runs
        self.audit_kv = audit_kv
        self.engine_parts_upto = engine_parts_upto
        self.kv_transfer, self.kv_store_bytes = kv_transfer, kv_store_bytes
        self.kv_store, self._owns_store = kv_store, False  # the KVStoreProcess of kv_transfer="store"

    # -- lifecycle --------------------------------------------------------------------------------
    def __enter__(self) -> DisaggregatedCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer_for(self.model)
        try:
            if self.kv_transfer == "store" and self.kv_store is None:
                from lab_utils.kvstore.store import KVStoreProcess

                self.kv_store, self._owns_store = KVStoreProcess(self.kv_store_bytes), True
            self._start_workers()
        except BaseException:
            self.close()
            raise

    def _start_workers(self) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        eos = {self.tokenizer.eos_token_id} - {None}
        learner_dir = None
        if self.learner_parts:  # fail here, in the caller, when a part is missing or does not load
            from lab_utils.course import learner_parts
            from lab_utils.disagg.workers import load_disagg_parts

            load_disagg_parts(self.learner_parts)
            learner_dir = str(learner_parts.learner_dir().resolve())
        if self.engine_parts_upto:  # the same: a saved part that does not load fails here
            from lab_utils.course import learner_parts

            learner_parts.parts(upto=self.engine_parts_upto, quiet=True)
            learner_dir = str(learner_parts.learner_dir().resolve())
        self._queues = {"prefill": ctx.Queue(), "decode": ctx.Queue()}
        p_read, p_write = ctx.Pipe(duplex=False)
        d_read, d_write = ctx.Pipe(duplex=False)
        kv_read, kv_write = ctx.Pipe(duplex=False)  # the KV channel, prefill -> decode, bypassing the router
        clients = {w: self.kv_store.client() if self.kv_transfer == "store" else None for w in ("prefill", "decode")}
        self._procs = {
            "prefill": ctx.Process(target=prefill_main, name="lab-prefill", daemon=True,
                                   args=(self.model, self.prefill_config, self.placement.prefill, self.dtype, eos,
                                         self._queues["prefill"], p_write, kv_write, self.threads,
                                         self.learner_parts, learner_dir, self.audit_kv, self.engine_parts_upto,
                                         clients["prefill"])),
            "decode": ctx.Process(target=decode_main, name="lab-decode", daemon=True,
                                  args=(self.model, self.decode_config, self.placement.decode, self.dtype, eos,
                                        self._queues["decode"], d_write, kv_read, self.threads,
                                        self.learner_parts, learner_dir, self.audit_kv, self.engine_parts_upto,
                                        clients["decode"])),
        }
        for p in self._procs.values():
            p.start()
        for c in (p_write, d_write, kv_read, kv_write):
            c.close()  # the children hold their ends; closing ours lets a death show as EOF
        self._conns = {"prefill": p_read, "decode": d_read}
        ready: set[str] = set()
        deadline = time.perf_counter() + self.startup_timeout_s
        while len(ready) < 2:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TimeoutError(f"workers did not start within startup_timeout_s={self.startup_timeout_s}")
            for who, conn in self._conns.items():
                if who in ready or not conn.poll(min(left, 0.2)):
                    continue
                try:
                    msg = conn.recv()
                except EOFError:
                    raise RuntimeError(f"{who} worker exited during start-up "
                                       f"(exit code {self._procs[who].exitcode})") from None
                if msg[0] == "error":
                    raise RuntimeError(f"{who} worker failed during start-up:\n{msg[2]}")
                ready.add(who)
                self.learner_parts_ran[who] = list(msg[2]) if len(msg) > 2 else []
        self._healthy = True

    def _stop_workers(self) -> None:
        for q in getattr(self, "_queues", {}).values():
            try:
                q.put(("stop",))
            except (OSError, ValueError):
                pass
        stop_processes(list(self._procs.values()), grace_s=3.0)
        for c in self._conns.values():
            c.close()
        for q in getattr(self, "_queues", {}).values():
            q.cancel_join_thread()  # never block on a queue whose reader is gone
            q.close()
        self._procs, self._conns, self._queues = {}, {}, {}
        self._healthy = False

    def close(self) -> None:
        """Stop both workers (join, then terminate, then kill) and the store the cluster started: no process
        outlives the cluster."""
        self._stop_workers()
        if self._owns_store and self.kv_store is not None:
            self.kv_store.close()
            self.kv_store, self._owns_store = None, False

    def kill_decode_worker(self) -> None:
        """SIGKILL the decode worker (fault-injection demo): the router notices at its next look."""
        p = self._procs.get("decode")
        if p is not None and p.is_alive():
            p.kill()
            p.join(timeout=10)

    @property
    def processes(self) -> dict[str, object]:
        return dict(self._procs)

    # -- serving ----------------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, arrival_times=None,
                 on_output=None, timeout_s: float = 600.0) -> list[RequestOutput]:
        """Serve the prompts (arriving `arrival_times` seconds after the call, default all at once); outputs in
        prompt order, the same objects as `LLMEngine.generate`. `on_output(out)` is called as each finishes."""
        if not self._healthy:
            self._stop_workers()
            self._start_workers()
        reqs = _requests(self.tokenizer, prompts, params, arrival_times)
        if any(sp.stop for _, _, sp, _ in reqs):
            raise ValueError("stop strings need a tokenizer in the workers; use SamplingParams.stop_token_ids")
        self._batches += 1
        t0 = now()
        tracked = {f"b{self._batches}-{i}": _Tracked(text, ids, sp, t0 + a) for i, (text, ids, sp, a) in enumerate(reqs)}
        order = sorted(tracked, key=lambda r: tracked[r].arrival)
        deadline = time.perf_counter() + timeout_s
        while any(t.state != "done" for t in tracked.values()):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"generate did not finish within timeout_s={timeout_s}")
            for rid in order:
                t = tracked[rid]
                if t.state == "pending" and t.arrival <= now():
                    self._queues["prefill"].put(("req", rid, t.token_ids, t.params, t.arrival))
                    t.state = "prefill"
            waiting = [t.arrival for t in tracked.values() if t.state == "pending"]
            timeout = max(0.0, min(waiting) - now()) if waiting else 1.0
            watch = list(self._conns.values()) + [p.sentinel for p in self._procs.values()]
            for ready in wait(watch, timeout=min(timeout, 1.0)):
                who = next((w for w, c in self._conns.items() if c is ready), None)
                if who is None:
                    who = next((w for w, p in self._procs.items() if p.sentinel == ready), None)
                if who is None or not self._healthy:
                    continue
                self._handle(who, tracked, on_output)
                if not self._healthy:
                    break
        return [tracked[r].output for r in tracked]

    def _handle(self, who: str, tracked: dict[str, _Tracked], on_output) -> None:
        conn = self._conns[who]
        try:
            while conn.poll():
                msg = conn.recv()
                kind = msg[0]
                if kind == "error":
                    self._stop_workers()
                    raise RuntimeError(f"{msg[1]} worker failed:\n{msg[2]}")
                if kind == "finished" or kind == "out":
                    out = msg[1]
                    if kind == "out" and msg[2]:  # the decode half (it may arrive before the "sent" note)
                        self._records.setdefault(out.request_id, {}).update(msg[2])
                    self._finish(tracked, out, on_output)
                elif kind == "sent":
                    self._records.setdefault(msg[1], {}).update(msg[2])
                    if msg[1] in tracked and tracked[msg[1]].state == "prefill":
                        tracked[msg[1]].state = "decode"
                elif kind == "kv_failed":
                    self._worker_died("decode", tracked, on_output)
                    return
        except (EOFError, ConnectionResetError, OSError):
            pass
        if not self._procs[who].is_alive():
            self._worker_died(who, tracked, on_output)

    def _finish(self, tracked, out: RequestOutput, on_output) -> None:
        t = tracked.get(out.request_id)
        if t is None or t.state == "done":
            return
        out.prompt, out.text = t.prompt, _text(self.tokenizer, out.token_ids)
        t.output, t.state = out, "done"
        if on_output is not None:
            on_output(out)

    def _worker_died(self, who: str, tracked, on_output) -> None:
        proc = self._procs[who]
        proc.join(timeout=5)
        code = proc.exitcode
        lost = [r for r, t in tracked.items() if t.state in ("prefill", "decode")]
        self.failures.append(WorkerFailure(who, code, lost, self.on_worker_failure))
        self._stop_workers()
        if self.on_worker_failure == "requeue":
            self._start_workers()
            for r in lost:
                tracked[r].state = "pending"  # re-sent (and re-prefilled) at once: its arrival has passed
                self._records.pop(r, None)
            self.num_requeued += len(lost)
            return
        reason = f"error: {who} worker died (exit code {code}) before this request finished"
        for r, t in tracked.items():
            if t.state != "done":
                why = reason if r in lost else f"error: {who} worker died before this request was served"
                out = RequestOutput(r, t.prompt, t.token_ids, [], "", True, why, RequestMetrics(t.arrival))
                self._finish(tracked, out, on_output)

    # -- statistics -------------------------------------------------------------------------------
    def kv_handoff_check(self) -> dict:
        """With `audit_kv`: every handed-off request's KV blocks compared between the prefill worker's cache (at
        export) and the decode worker's (right after the swap-in), block by block. Returns the numbers of
        requests and blocks compared and the mismatches as (request id, block index, or 'never swapped in'). A
        request recomputed by the decode worker (its blocks were gone from the store) had no hand-off: not compared."""
        if not self.audit_kv:
            raise ValueError("kv_handoff_check needs DisaggregatedCluster(..., audit_kv=True)")
        requests = blocks = 0
        mismatched: list[tuple[str, int | str]] = []
        for rid, r in self._records.items():
            if "prefill_kv_blocks" not in r or r.get("recomputed"):
                continue
            requests += 1
            mine, theirs = r["prefill_kv_blocks"], r.get("decode_kv_blocks")
            if theirs is None:
                mismatched.append((rid, "never swapped in"))
                continue
            blocks += len(mine)
            mismatched += [(rid, i) for i in range(max(len(mine), len(theirs)))
                           if i >= len(mine) or i >= len(theirs) or mine[i] != theirs[i]]
        return {"requests": requests, "blocks": blocks, "mismatched": mismatched}

    def worker_stats(self, timeout_s: float = 60.0) -> dict[str, dict]:
        """Ask both workers, between `generate` calls, for their blocks (`referenced_blocks` 0 and
        `unfinished_requests` 0 once everything has ended: nothing leaked) and their side of the store traffic
        (`store_handoff.worker_report`)."""
        if not self._healthy:
            raise RuntimeError("the workers are not running: call start() or generate() first")
        for who in ("prefill", "decode"):
            self._queues[who].put(("stats",))
        got: dict[str, dict] = {}
        deadline = time.perf_counter() + timeout_s
        while len(got) < 2:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"workers did not report within timeout_s={timeout_s}")
            for who, conn in self._conns.items():
                if who in got or not conn.poll(0.1):
                    continue
                msg = conn.recv()
                if msg[0] == "stats":
                    got[msg[1]] = msg[2]
                elif msg[0] == "sent":  # a hand-off note that came after its request had finished
                    self._records.setdefault(msg[1], {}).update(msg[2])
                elif msg[0] == "error":
                    raise RuntimeError(f"{msg[1]} worker failed:\n{msg[2]}")
        return got

    def store_stats(self):
        """The KV store's own count (`StoreStats`: blocks and bytes held, put, got, dropped to make room)."""
        if self.kv_store is None:
            raise ValueError("store_stats needs DisaggregatedCluster(..., kv_transfer='store')")
        client = self.kv_store.client()
        try:
            return client.store_stats()
        finally:
            client.close()

    def transfer_stats(self) -> dict:
        """KV transfers so far: count, bytes, and seconds per transfer (means; see `TransferRecord`). With
        `kv_transfer="store"`, `bytes_total` is what took the pipe (headers and partial blocks), and the store's
        part is added: payload bytes put by the prefill worker and got by the decode worker, blocks put, found
        there already, got and missing, seconds on each side, and requests recomputed because a block was
        missing; the seconds per transfer then include the store's."""
        recs = [r for r in self._records.values() if "bytes" in r]
        def mean(key):
            xs = [r[key] for r in recs if key in r]
            return statistics.fmean(xs) if xs else 0.0
        total = sum(r["bytes"] for r in recs)
        busy = sum(r.get("serialize_s", 0) + r.get("send_s", 0) + r.get("recv_s", 0) + r.get("load_s", 0)
                   + r.get("store_put_s", 0) + r.get("store_get_s", 0) for r in recs)
        lat = [r["received_at"] - r["sent_at"] for r in recs if "received_at" in r]
        out = {
            "num_transfers": len(recs),
            "bytes_total": total,
            "bytes_per_request_mean": total / len(recs) if recs else 0.0,
            "bytes_per_token_mean": total / max(sum(r["num_tokens"] for r in recs), 1),
            "seconds_per_transfer_mean": busy / len(recs) if recs else 0.0,
            "serialize_s_mean": mean("serialize_s"),
            "send_s_mean": mean("send_s"),
            "recv_s_mean": mean("recv_s"),
            "load_s_mean": mean("load_s"),
            "latency_s_mean": statistics.fmean(lat) if lat else 0.0,
            "throughput_MBps": total / busy / 1e6 if busy else 0.0,
            "num_requeued": self.num_requeued,
            "num_worker_failures": len(self.failures),
        }
        if self.kv_transfer == "store":
            def total_of(key):
                return sum(r.get(key, 0) for r in recs)
            store_bytes = total_of("store_put_bytes") + total_of("store_get_bytes")
            out.update(
                kv_transfer="store",
                store_put_bytes_total=total_of("store_put_bytes"), store_get_bytes_total=total_of("store_get_bytes"),
                store_blocks_put=total_of("store_blocks_put"), store_blocks_held=total_of("store_blocks_held"),
                store_blocks_got=total_of("store_blocks_got"), store_blocks_missing=total_of("store_blocks_missing"),
                store_put_s_mean=mean("store_put_s"), store_get_s_mean=mean("store_get_s"),
                num_recomputed=sum(1 for r in recs if r.get("recomputed")),
                throughput_MBps=(total + store_bytes) / busy / 1e6 if busy else 0.0)
        return out
