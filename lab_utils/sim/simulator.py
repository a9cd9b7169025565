"""A discrete-event simulator of a serving cluster that runs the engine's own Scheduler and BlockManager.

`SimEngine` is `LLMEngine.step()` with the forward pass replaced by a clock: the real `Scheduler.schedule()`
decides who runs (same policies, token budget, admission, preemption, prefix cache), the step's duration comes
from a cost function of the batch's shape (the roofline in `cost_model`, or a fitted one for this CPU), and the
sampled token is a placeholder. So a simulated policy cannot drift from the real one: it *is* the real one.

A cluster is a heap of events on one simulated clock: request arrivals, step ends, KV transfers.
- `simulate(requests, engines)`: colocated replicas behind a least-loaded router (prefill and decode share
  each engine's steps).
- `simulate_disaggregated(requests, prefill, decode, kv_transfer_s)`: prefill engines compute the prompt and
  the first token, the KV travels (`kv_transfer_s(prompt_len)`), and a decode engine continues the sequence
  with the prompt's KV already in place (DistServe, Splitwise, vLLM's disaggregated prefill).
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from lab_utils.bench import metrics
from lab_utils.bench.workload import arrival_times, sample_lengths
from lab_utils.engine.kv.block_manager import BlockManager
from lab_utils.engine.config import EngineConfig
from lab_utils.engine.request import Request, Status
from lab_utils.engine.sampling_params import SamplingParams
from lab_utils.engine.scheduler import Scheduler

PLACEHOLDER_TOKEN = 0  # the simulator knows when a token exists, not which one
StepTimeFn = Callable[[list[tuple[int, int]], int], float]  # (start, new tokens) per sequence, num sampled -> s


# --------------------------------------------------------------------------------------------- requests
@dataclass
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    output_len: int
    arrival_time: float

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


def from_workload(workload) -> list[SimRequest]:
    """The same requests a real backend serves (`lab_utils.bench.workload.Workload`)."""
    return [SimRequest(r.request_id, list(r.prompt_token_ids), r.output_len, r.arrival_time) for r in workload.requests]


def synthetic_requests(num: int, input_len: int, output_len: int, request_rate: float, seed: int = 0,
                       input_dist: str = "uniform", output_dist: str = "uniform", burstiness: float = 1.0,
                       range_ratio: float = 0.5) -> list[SimRequest]:
    """Requests with random (distinct) prompt tokens: no prefix is shared, so no cache hit is accidental."""
    rng = np.random.default_rng(seed)
    ins = sample_lengths(input_dist, input_len, num, rng, range_ratio=range_ratio)
    outs = sample_lengths(output_dist, output_len, num, rng, range_ratio=range_ratio)
    arr = arrival_times(num, request_rate, rng, burstiness)
    return [SimRequest(str(i), [int(t) for t in rng.integers(1, 1 << 30, size=ins[i])], outs[i], arr[i])
            for i in range(num)]


@dataclass
class Timeline:
    """One request's timestamps on the simulated clock; the attribute names `bench.metrics` reads."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    token_times: list[float] = field(default_factory=list)
    first_scheduled_time: float | None = None
    kv_transfer_s: float = 0.0
    preemptions: int = 0

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def finish_time(self) -> float | None:
        return self.token_times[-1] if self.token_times else None


# --------------------------------------------------------------------------------------------- one engine
class SimEngine:
    """The engine loop with a clock instead of a model. `num_blocks` sizes the KV pool (from `kv_capacity`)."""

    def __init__(self, config: EngineConfig, num_blocks: int, step_time: StepTimeFn, name: str = "engine",
                 max_model_len: int = 1 << 20) -> None:
        self.config, self.name, self.step_time, self.max_model_len = config, name, step_time, max_model_len
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          config.watermark)
        self.scheduler = Scheduler(config, self.block_manager)  # no swap hooks: preemption recomputes
        self.busy_until: float | None = None  # end of the step in flight
        self._inflight = None
        self.num_steps = 0
        self.busy_time = 0.0
        self.step_log: list[dict] = []
        self.rejected: list[Request] = []

    @property
    def load(self) -> int:
        return self.scheduler.num_running + len(self.scheduler.waiting)

    def add(self, req: Request) -> bool:
        """Queue `req`; False (and the request is rejected) if its full length can never fit in the pool."""
        need = self.block_manager.blocks_needed(min(req.num_prompt_tokens + req.params.max_tokens, self.max_model_len))
        if need > self.block_manager.num_blocks:
            req.status, req.finish_reason = Status.REJECTED, f"rejected: needs {need} blocks, pool has {self.block_manager.num_blocks}"
            self.rejected.append(req)
            return False
        self.scheduler.add(req)
        return True

    def start_step(self, t: float) -> float | None:
        """Schedule at time `t`; return when the step ends (None: nothing to run)."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.has_work():
                raise RuntimeError(f"{self.name}: scheduler made no progress at t={t:.4f}; this is a bug")
            return None
        shape, sampled = [], []
        for req, n in sched.scheduled:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = t
            shape.append((req.num_computed_tokens, n))
            if req.num_computed_tokens + n == req.num_tokens:
                sampled.append(req)
        dt = float(self.step_time(shape, len(sampled)))
        if not dt > 0:
            raise ValueError(f"step_time returned {dt!r} s for {shape[:4]}...; it must be > 0")
        self._inflight = (sched, sampled)
        self.busy_until = t + dt
        self.busy_time += dt
        self.step_log.append({"start": t, "end": t + dt, "num_tokens": sched.num_tokens,
                              "num_seqs": len(shape), "preempted": len(sched.preempted)})
        return self.busy_until

    def finish_step(self, t: float) -> list[Request]:
        """Apply the step that ended at `t`: tokens computed, one token sampled per due sequence. Returns the
        requests that finished."""
        sched, sampled = self._inflight
        self._inflight, self.busy_until = None, None
        for req, n in sched.scheduled:
            req.num_computed_tokens += n
            self.block_manager.commit_full_blocks(req)
        done = []
        for req in sampled:
            req.token_ids.append(PLACEHOLDER_TOKEN)
            req.metrics.token_times.append(t)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = t
            if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
                self.scheduler.finish(req, Status.FINISHED)
                req.finish_reason, req.metrics.finish_time = "length", t
                done.append(req)
        self.num_steps += 1
        return done


# --------------------------------------------------------------------------------------------- results
@dataclass
class SimResult:
    timelines: list[Timeline]
    engines: list[SimEngine]
    kv_transfers: int = 0
    kv_bytes: float = 0.0

    def summary(self, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> dict:
        """`bench.metrics.summarize` over the simulated timestamps (vLLM `bench serve` keys)."""
        res = metrics.summarize(self.timelines, None, slo_ttft_ms, slo_tpot_ms)
        res["num_preemptions"] = sum(e.scheduler.num_preemptions for e in self.engines)
        res["num_rejected"] = sum(len(e.rejected) for e in self.engines)
        res["kv_transfers"], res["kv_bytes"] = self.kv_transfers, self.kv_bytes
        res["utilization"] = [e.busy_time / res["duration"] for e in self.engines]
        return res

    def check_all_free(self) -> None:
        for e in self.engines:
            e.block_manager.check_all_free()


def _request(sr: SimRequest, max_tokens: int) -> Request:
    return Request(sr.request_id, None, sr.prompt_token_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   sr.arrival_time)


class _Clock:
    """The event heap: (time, tie-breaker, action)."""

    def __init__(self) -> None:
        self.heap: list = []
        self.count = itertools.count()

    def at(self, t: float, action: Callable[[float], None]) -> None:
        heapq.heappush(self.heap, (t, next(self.count), action))

    def run(self) -> None:
        while self.heap:
            t, _, action = heapq.heappop(self.heap)
            action(t)


def _kick(clock: _Clock, eng: SimEngine, t: float, on_done: Callable[[SimEngine, list[Request], float], None]) -> None:
    """Start `eng`'s next step at `t` if it is idle and has work."""
    if eng.busy_until is not None:
        return
    end = eng.start_step(t)
    if end is None:
        return

    def step_done(t_end: float) -> None:
        finished = eng.finish_step(t_end)
        on_done(eng, finished, t_end)
        _kick(clock, eng, t_end, on_done)

    clock.at(end, step_done)


def _least_loaded(engines: Sequence[SimEngine]) -> SimEngine:
    return min(engines, key=lambda e: (e.load, e.busy_until is not None))


def _check(requests: Sequence[SimRequest], engines: Sequence[SimEngine], what: str) -> None:
    if not requests:
        raise ValueError("requests is empty: give at least one SimRequest")
    if not engines:
        raise ValueError(f"{what} is empty: give at least one SimEngine")
    for r in requests:
        if r.output_len < 1 or not r.prompt_token_ids:
            raise ValueError(f"request {r.request_id}: prompt and output_len must be >= 1 (got "
                             f"{r.input_len}, {r.output_len})")


def simulate(requests: Sequence[SimRequest], engines: Sequence[SimEngine]) -> SimResult:
    """Colocated serving: each request goes to the least-loaded engine and stays there."""
    _check(requests, engines, "engines")
    clock = _Clock()
    reqs: dict[str, Request] = {}

    def on_done(eng, finished, t):
        pass

    def arrive(sr: SimRequest) -> Callable[[float], None]:
        def go(t: float) -> None:
            eng = _least_loaded(engines)
            req = reqs[sr.request_id] = _request(sr, sr.output_len)
            if eng.add(req):
                _kick(clock, eng, t, on_done)
        return go

    for sr in requests:
        clock.at(sr.arrival_time, arrive(sr))
    clock.run()
    timelines = [Timeline(r.request_id, r.metrics.arrival_time, r.num_prompt_tokens, list(r.metrics.token_times),
                          r.metrics.first_scheduled_time, 0.0, r.metrics.preemptions) for r in reqs.values()]
    return SimResult(timelines, list(engines))


def simulate_disaggregated(requests: Sequence[SimRequest], prefill: Sequence[SimEngine], decode: Sequence[SimEngine],
                           kv_transfer_s: Callable[[int], float], kv_bytes: Callable[[int], float] | None = None
                           ) -> SimResult:
    """Prefill pool -> KV transfer -> decode pool. The prefill engine produces the first token (TTFT), frees its
    blocks, and the decode engine admits the sequence with `num_computed_tokens = prompt` (its KV arrived).

    Two simplifications, both in disaggregation's favour: transfers do not share the link (each gets the full
    bandwidth), and the prefill side frees its blocks when the first token exists rather than when the KV has
    left. A request the decode pool can never hold is rejected there and keeps only its first token."""
    _check(requests, prefill, "prefill")
    _check(requests, decode, "decode")
    clock = _Clock()
    lines: dict[str, Timeline] = {}
    by_id = {sr.request_id: sr for sr in requests}
    stats = {"n": 0, "bytes": 0.0}

    def decode_done(eng, finished, t):
        for req in finished:
            lines[req.request_id].token_times.extend(req.metrics.token_times)

    def kv_arrived(req_p: Request) -> Callable[[float], None]:
        def go(t: float) -> None:
            sr = by_id[req_p.request_id]
            req = _request(sr, sr.output_len)
            req.token_ids.append(PLACEHOLDER_TOKEN)  # the first token, sampled on the prefill side
            req.num_computed_tokens = sr.input_len  # the prompt's KV is here: only decoding is left
            eng = _least_loaded(decode)
            if eng.add(req):
                _kick(clock, eng, t, decode_done)
        return go

    def prefill_done(eng, finished, t):
        for req in finished:
            line = lines[req.request_id]
            line.token_times.append(t)
            line.first_scheduled_time = req.metrics.first_scheduled_time
            line.preemptions += req.metrics.preemptions
            if by_id[req.request_id].output_len > 1:
                dt = float(kv_transfer_s(req.num_prompt_tokens))
                line.kv_transfer_s = dt
                stats["n"] += 1
                stats["bytes"] += kv_bytes(req.num_prompt_tokens) if kv_bytes else 0.0
                clock.at(t + dt, kv_arrived(req))

    def arrive(sr: SimRequest) -> Callable[[float], None]:
        def go(t: float) -> None:
            lines[sr.request_id] = Timeline(sr.request_id, sr.arrival_time, sr.input_len)
            eng = _least_loaded(prefill)
            if eng.add(_request(sr, 1)):  # the prefill side makes exactly one token
                _kick(clock, eng, t, prefill_done)
        return go

    for sr in requests:
        clock.at(sr.arrival_time, arrive(sr))
    clock.run()
    return SimResult([lines[sr.request_id] for sr in requests], list(prefill) + list(decode), stats["n"], stats["bytes"])


# --------------------------------------------------------------------------------------------- building blocks
def roofline_step_time(model, hw, tp: int = 1, pp: int = 1) -> StepTimeFn:
    """The cost model as a step-time function for `SimEngine`."""
    from lab_utils.sim.cost_model import step_cost

    def f(shape: list[tuple[int, int]], num_sampled: int) -> float:
        return step_cost(model, hw, shape, num_sampled, tp=tp, pp=pp).time_s
    return f


def make_engine(model, hw, config: EngineConfig, tp: int = 1, pp: int = 1, name: str = "engine",
                gpu_memory_utilization: float = 0.9, max_num_blocks: int | None = None) -> SimEngine:
    """One serving instance on tp·pp devices of `hw`, its KV pool sized like vLLM sizes it."""
    from lab_utils.sim.cost_model import kv_capacity

    cap = kv_capacity(model, hw, tp * pp, gpu_memory_utilization, tp=tp)
    if not cap["fits"]:
        raise ValueError(f"{model.name} ({model.weight_bytes / 1e9:.1f} GB of weights) does not fit on "
                         f"{tp * pp} x {hw.name} at gpu_memory_utilization={gpu_memory_utilization}; use more devices")
    blocks = cap["kv_tokens"] // config.block_size
    if max_num_blocks is not None:
        blocks = min(blocks, max_num_blocks)
    return SimEngine(config, max(1, blocks), roofline_step_time(model, hw, tp, pp), name)


def kv_transfer_time(model, link_bw: float, latency_s: float = 0.0) -> Callable[[int], float]:
    """Seconds to move a prompt's KV (all layers) over a link of `link_bw` bytes/s."""
    if not link_bw > 0:
        raise ValueError(f"link_bw={link_bw!r} is invalid: must be > 0 bytes/s")
    return lambda n_tokens: n_tokens * model.kv_bytes_per_token / link_bw + latency_s


def goodput_at_attainment(run_at_rate: Callable[[float], dict], rates: Sequence[float], target: float = 0.9
                          ) -> tuple[float, list[dict]]:
    """DistServe's goodput: the highest request rate whose SLO attainment is still >= `target`.
    `run_at_rate(rate)` returns a summary with `slo_attainment`; rates are tried in increasing order."""
    best, rows = 0.0, []
    for r in sorted(rates):
        s = run_at_rate(r)
        rows.append(dict(rate=r, **{k: s[k] for k in ("slo_attainment", "mean_ttft_ms", "mean_tpot_ms",
                                                         "p90_ttft_ms", "p90_tpot_ms", "output_throughput")}))
        if s["slo_attainment"] >= target:
            best = r
    return best, rows

