"""`run_parallel`: spawn one process per rank, rendezvous over a free TCP port, gather rank 0's results.

Processes are started with the `spawn` method (a clean interpreter: no forked threads or CUDA state) and are
always joined; on an error or a timeout every still-running rank is terminated, then killed, so no process
outlives the call. `mode="single"` runs in this process: there is nothing to communicate.
"""
from __future__ import annotations

import os
import queue as queue_mod
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from lab_utils.parallel.comm import Comm, free_tcp_port, pick_backend
from lab_utils.parallel.runner import MODES, RankResult, run_rank

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ParallelResult:
    """Greedy outputs and rank 0's timings of one run. Times exclude process start-up and model loading."""

    mode: str
    world_size: int
    backend: str | None
    device: str
    token_ids: list[list[int]]  # generated ids per prompt (prompt excluded)
    total_time_s: float  # generation wall time on rank 0
    step_times_s: list[float]  # one forward pass (= one generated token) each, rank 0
    comm_time_s: float  # time inside all_reduce / send / recv / broadcast on rank 0
    comm_share: float  # comm_time_s / sum(step_times_s)
    bytes_communicated: int  # payload bytes rank 0 passed to collectives and sends, whole run
    comm_calls: int
    tokens_per_s: float
    startup_s: float = 0.0  # spawn + rendezvous + model load, wall time seen by the caller
    latency_per_call_s: float = 0.0  # one decode-sized message with both ranks ready (calibrated after the run)
    per_rank: list[dict] = field(default_factory=list)
    learner_parts: list[list[str]] = field(default_factory=list)  # per rank: the learner's parts it ran

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_communicated / max(len(self.step_times_s), 1)

    @property
    def transfer_time_estimate_s(self) -> float:
        """calls x calibrated latency: the part of `comm_time_s` spent moving data (the rest is waiting)."""
        return min(self.comm_calls * self.latency_per_call_s, self.comm_time_s)

    @property
    def wait_time_estimate_s(self) -> float:
        """Time in communication calls spent waiting for the other rank (imbalance, pipeline bubble, contention)."""
        return self.comm_time_s - self.transfer_time_estimate_s


def _rank_main(rank: int, world_size: int, port: int, backend: str, device: str, model: str,
               prompts: list[list[int]], max_tokens: int, mode: str, dtype: str, threads: int, results,
               learner_parts=(), learner_dir: str | None = None) -> None:
    import torch.distributed as dist

    if learner_dir:  # the rank loads the learner's saved parts from the caller's my_engine/
        os.environ["LAB_LEARNER_DIR"] = learner_dir

    torch.set_num_threads(threads)
    try:
        dev = torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=120))
        comm = Comm(rank, world_size, dev)
        res = run_rank(model, prompts, max_tokens, mode, comm, DTYPES[dtype], learner_parts)
        results.put(("ok", rank, res))
    except BaseException:  # report, never hang the parent
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _tokenize(model: str, prompts) -> list[list[int]]:
    if all(not isinstance(p, str) for p in prompts):
        return [[int(t) for t in p] for p in prompts]
    from lab_utils.models.loader import model_folder
    from lab_utils.models.registry import lookup
    from lab_utils.models.tokenizer import load_tokenizer

    spec, _ = lookup(model)
    tok = load_tokenizer(model_folder(spec.tokenizer_from if spec and spec.kind == "random" else model))
    return [tok(p, add_special_tokens=False).input_ids if isinstance(p, str) else list(p) for p in prompts]


def _result(mode, world, backend, device, ranks: list[RankResult], startup: float) -> ParallelResult:
    r0 = ranks[0]
    fwd = sum(r0.step_times_s)
    n_tok = sum(len(t) for t in r0.token_ids)
    return ParallelResult(mode, world, backend, device, r0.token_ids, r0.total_time_s, r0.step_times_s,
                          r0.comm_time_s, r0.comm_time_s / fwd if fwd else 0.0, r0.bytes_communicated,
                          r0.comm_calls, n_tok / r0.total_time_s if r0.total_time_s else 0.0, startup, r0.latency_per_call_s,
                          [dict(rank=r.rank, comm_time_s=r.comm_time_s, total_time_s=r.total_time_s,
                                bytes_communicated=r.bytes_communicated, load_time_s=r.load_time_s) for r in ranks],
                          [list(r.learner_parts) for r in ranks])


def run_parallel(model: str = "smollm2-135m", prompts=(), max_tokens: int = 16, mode: str = "tp",
                 world_size: int = 2, backend: str = "auto", device: str = "cpu", dtype: str = "float32",
                 threads_per_rank: int = 1, timeout_s: float = 600.0, learner_parts=()) -> ParallelResult:
    """Greedy-generate `max_tokens` for each prompt (text or token ids) with the model split over `world_size`
    processes; returns when every rank has exited. `backend="auto"`: NCCL on CUDA, gloo on CPU.
    `learner_parts` (mode "tp"): names of the learner's tensor-parallel parts every rank loads from my_engine/
    (`lab_utils.course.learner_parts.submit` saved them; `LAB_LEARNER_DIR` moves the folder) in place of the reference."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: must be one of {MODES}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: must be one of {tuple(DTYPES)}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is invalid: must be 'cpu' or 'cuda'")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r} is invalid: must be an int >= 1")
    ids = _tokenize(model, list(prompts))
    if not ids or any(not p for p in ids):
        raise ValueError("prompts must be a non-empty list of non-empty prompts")
    learner_parts = tuple(learner_parts)
    if learner_parts and mode != "tp":
        raise ValueError(f"learner_parts={learner_parts} are tensor-parallel parts: use mode='tp', not {mode!r}")
    if mode == "single":
        world_size = 1
    elif not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size={world_size!r} is invalid for mode={mode!r}: must be an int >= 2")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"device='cuda' with world_size={world_size} needs {world_size} GPUs, "
                         f"found {torch.cuda.device_count()} (one rank per GPU)")
    t0 = time.perf_counter()
    if mode == "single":
        old = torch.get_num_threads()
        torch.set_num_threads(threads_per_rank)
        try:
            dev = torch.device("cuda:0" if device == "cuda" else "cpu")
            r = run_rank(model, ids, max_tokens, mode, Comm(0, 1, dev), DTYPES[dtype])
        finally:
            torch.set_num_threads(old)
        return _result(mode, 1, None, device, [r], time.perf_counter() - t0 - r.total_time_s)
    backend = pick_backend(backend, device)
    return _launch(world_size, backend, device, model, ids, max_tokens, mode, dtype, threads_per_rank, timeout_s, t0,
                   learner_parts)


def _launch(world, backend, device, model, ids, max_tokens, mode, dtype, threads, timeout_s, t0,
            learner_parts=()) -> ParallelResult:
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_tcp_port()
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    procs = [ctx.Process(target=_rank_main, name=f"lab-rank{r}", daemon=True,
                         args=(r, world, port, backend, device, model, ids, max_tokens, mode, dtype, threads, results,
                               learner_parts, _learner_dir(learner_parts)))
             for r in range(world)]
    got: dict[int, RankResult] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.perf_counter() + timeout_s
        while len(got) < world:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TimeoutError(f"run_parallel(mode={mode!r}) did not finish within timeout_s={timeout_s}")
            try:
                status, rank, payload = results.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank process {dead[0].name} died with exit code {dead[0].exitcode}")
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            got[rank] = payload
        for p in procs:
            p.join(timeout=30)
    finally:
        stop_processes(procs)
        results.close()
        results.join_thread()
    total = got[0].total_time_s
    return _result(mode, world, backend, device, [got[r] for r in range(world)], time.perf_counter() - t0 - total)


def _learner_dir(learner_parts) -> str | None:
    if not learner_parts:
        return None
    from lab_utils.course.learner_parts import learner_dir
    from lab_utils.parallel.tensor_parallel import load_tp_parts

    load_tp_parts(learner_parts)  # fail here, in the caller, when a part is missing or does not load
    return str(learner_dir().resolve())


def stop_processes(procs, grace_s: float = 5.0) -> None:
    """Join each process; terminate the ones still running after `grace_s`, then kill. Never leaves one behind."""
    for p in procs:
        if p.pid is None:
            continue
        p.join(timeout=grace_s)
        if p.is_alive():
            p.terminate()
            p.join(timeout=grace_s)
        if p.is_alive():
            p.kill()
            p.join()
