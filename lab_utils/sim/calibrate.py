"""Fit this machine's effective roofline to the real engine, then check the simulator on a held-out workload.

1. Run the real `LLMEngine` (through `bench.backends.LabBackend`) on a workload whose steps vary: prefill-heavy
   chunks and decode steps of shrinking batches. Its step log says, per step, who ran and how many tokens.
2. Rebuild each step's shape (tokens already cached, new tokens) and its FLOPs and bytes from the cost model.
3. Fit peak FLOP/s, bandwidth and the per-step / per-sequence overheads so that
   max(FLOPs / peak, bytes / bandwidth) + c0 + c1 · seqs matches the measured step times (least relative error).
4. Simulate a *different* workload (other lengths, Poisson arrivals) with the fitted hardware and compare the
   simulated TTFT and TPOT with what the real engine measured on it.
"""
from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass

import numpy as np

from lab_utils.bench import metrics
from lab_utils.sim.cost_model import ModelSpec, step_cost
from lab_utils.sim.gpus import Hardware, cpu_hardware


@dataclass
class StepSample:
    batch: list[tuple[int, int]]  # (tokens already in the KV, new tokens) per sequence
    num_sampled: int
    seconds: float


def step_samples(run, workload) -> tuple[list[StepSample], float]:
    """Each logged step of a real `BenchRun` as a shape and a duration, plus the engine loop's median gap
    between steps (scheduling and bookkeeping that the step log's start..end does not include).

    Needs a run without prefix-cache hits and without preemption, so that every request's cached-token count
    can be replayed from the log alone."""
    if run.stats.get("num_preemptions", 0):
        raise ValueError(f"the run preempted {run.stats['num_preemptions']} times; calibrate with a larger KV pool")
    if run.stats.get("prefix_cache_hit_rate", 0):
        raise ValueError("the run hit the prefix cache; calibrate with enable_prefix_caching=False")
    prompt = {r.request_id: r.input_len for r in workload.requests}
    computed = dict.fromkeys(prompt, 0)
    produced = dict.fromkeys(prompt, 0)
    out, gaps = [], []
    prev_end = None
    for s in run.step_log:
        batch, sampled = [], 0
        for rid, n in s["requests"]:
            batch.append((computed[rid], n))
            computed[rid] += n
            if computed[rid] == prompt[rid] + produced[rid]:
                produced[rid] += 1
                sampled += 1
        out.append(StepSample(batch, sampled, s["end"] - s["start"]))
        if prev_end is not None:
            gaps.append(s["start"] - prev_end)
        prev_end = s["end"]
    busy_gaps = [g for g in gaps if g >= 0]
    gap = statistics.median(busy_gaps) if busy_gaps else 0.0
    return out, gap


def _flops_bytes(model: ModelSpec, samples: list[StepSample]) -> tuple[np.ndarray, np.ndarray]:
    unit = Hardware("unit", 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0)  # compute_s = FLOPs, memory_s = bytes
    costs = [step_cost(model, unit, s.batch, s.num_sampled) for s in samples]
    return np.array([c.compute_s for c in costs]), np.array([c.memory_s for c in costs])


def _fit_overheads(roof: np.ndarray, seqs: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least relative squared error of y ≈ roof + c0 + c1·seqs with c0, c1 >= 0; returns (c0, c1, loss)."""
    w = 1.0 / y
    r = (y - roof) * w
    best = None
    for use in ((1, 1), (1, 0), (0, 1), (0, 0)):
        cols = [c for c, u in zip((w, seqs * w), use) if u]
        if cols:
            A = np.stack(cols, 1)
            coef, *_ = np.linalg.lstsq(A, r, rcond=None)
            if (coef < 0).any():
                continue
        else:
            coef = np.array([])
        it = iter(coef)
        c0 = float(next(it)) if use[0] else 0.0
        c1 = float(next(it)) if use[1] else 0.0
        loss = float(np.sum((r - c0 * w - c1 * seqs * w) ** 2))
        if best is None or loss < best[2]:
            best = (c0, c1, loss)
    return best


def fit_hardware(model: ModelSpec, samples: list[StepSample], loop_gap_s: float = 0.0) -> tuple[Hardware, dict]:
    """This CPU's effective peak FLOP/s, bandwidth and overheads, fitted on measured steps (coarse-to-fine grid
    over the two peaks, closed-form overheads). `loop_gap_s` (the engine loop between steps) is added to the
    per-step overhead, since the simulated clock starts the next step when one ends."""
    if len(samples) < 4:
        raise ValueError(f"need >= 4 measured steps to fit 4 numbers, got {len(samples)}")
    F, B = _flops_bytes(model, samples)
    y = np.array([s.seconds for s in samples])
    seqs = np.array([len(s.batch) for s in samples], dtype=float)
    lo_f, hi_f, lo_b, hi_b = 8.0, 13.0, 8.0, 12.0  # log10 search ranges: 0.1 GFLOP/s..10 TFLOP/s, 0.1..1000 GB/s
    best = None
    for _ in range(3):
        for lf, lb in itertools.product(np.linspace(lo_f, hi_f, 41), np.linspace(lo_b, hi_b, 41)):
            roof = np.maximum(F / 10 ** lf, B / 10 ** lb)
            c0, c1, loss = _fit_overheads(roof, seqs, y)
            if best is None or loss < best[0]:
                best = (loss, lf, lb, c0, c1)
        _, lf, lb, _, _ = best
        sf, sb = (hi_f - lo_f) / 20, (hi_b - lo_b) / 20
        lo_f, hi_f, lo_b, hi_b = lf - sf, lf + sf, lb - sb, lb + sb
    loss, lf, lb, c0, c1 = best
    hw = cpu_hardware(10 ** lf, 10 ** lb, c0 + loop_gap_s, c1)
    pred = np.maximum(F / hw.peak_flops, B / hw.mem_bw) + c0 + c1 * seqs
    rel = np.abs(pred - y) / y
    report = dict(peak_gflops=float(hw.peak_flops / 1e9), mem_bw_gb_s=float(hw.mem_bw / 1e9), step_overhead_ms=c0 * 1e3,
                  loop_gap_ms=loop_gap_s * 1e3, seq_overhead_ms=c1 * 1e3, num_steps=len(samples),
                  step_median_rel_err=float(np.median(rel)), step_mean_rel_err=float(np.mean(rel)),
                  memory_bound_steps=int(np.sum(B / hw.mem_bw > F / hw.peak_flops)),
                  step_kind_rel_err=kind_error(samples, rel))
    return hw, report


def kind_error(samples: list[StepSample], rel: np.ndarray) -> float:
    """The worse of the fit's median relative errors on steps with prompt tokens and on decode-only steps (either
    kind absent: the other's). TTFT rests on the first kind, TPOT on the second: where the model misses one kind by
    more than a claim's bound (a GPU whose decode steps replay graphs in ms while any prompt token costs an eager
    ~100 ms step: no roofline plus overheads expresses that), the simulator cannot be judged on this device."""
    prefill = np.array([any(new > 1 for _, new in s.batch) for s in samples])
    kinds = [rel[m] for m in (prefill, ~prefill) if m.any()]
    return max(float(np.median(k)) for k in kinds)


def simulate_like(run, workload, config, model: ModelSpec, hw: Hardware, num_blocks: int):
    """Replay `workload` in the simulator with the same engine config and KV pool as the real run."""
    from lab_utils.sim.simulator import SimEngine, from_workload, roofline_step_time, simulate

    eng = SimEngine(config, num_blocks, roofline_step_time(model, hw), "sim")
    return simulate(from_workload(workload), [eng])


def compare(real_requests, sim_result) -> dict:
    """Mean TTFT and TPOT, measured vs simulated, and their relative errors |sim − real| / real."""
    real = metrics.summarize(real_requests)
    sim = sim_result.summary()
    out = {}
    for k in ("mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms"):
        out[f"real_{k}"], out[f"sim_{k}"] = real[k], sim[k]
        out[f"rel_err_{k[5:-3]}"] = abs(sim[k] - real[k]) / real[k] if real[k] else math.nan
    out["max_rel_err"] = max(out["rel_err_ttft"], out["rel_err_tpot"])
    return out


def spread(summaries: list[dict]) -> dict:
    """How far repeats lie apart: (max - min) / mean of their mean TTFT and of their mean TPOT. A prediction
    cannot be judged more finely than the measurement agrees with itself."""
    out = {}
    for k in ("mean_ttft_ms", "mean_tpot_ms"):
        xs = [s[k] for s in summaries]
        mean = sum(xs) / len(xs)
        out[f"spread_{k[5:-3]}"] = (max(xs) - min(xs)) / mean if mean else math.nan
    return out


@dataclass
class Calibration:
    hardware: Hardware
    fit: dict  # fitted numbers and the per-step fit error
    comparison: dict  # held-out: measured vs simulated TTFT/TPOT, their relative errors, the repeats' spread
    sim_result: object
    real_requests: list


def calibrate(backend, model: ModelSpec, fit_workload, held_workload) -> Calibration:
    """Fit on `fit_workload`, check on `held_workload`, run in the order fit, held, held, fit (ABBA): on a
    machine whose load drifts, the fit sees the same average conditions as the check. The two held-out runs
    are pooled (every request counted twice) for the measured side. `spread_ttft` and `spread_tpot` in the
    comparison: how far apart the repeats lie (the two fit runs, the two held-out runs, and the replays predicted
    from each fit run alone; the widest), the resolution of the measurement on both sides of the check."""
    runs = {"fit": [], "held": []}
    for which in ("fit", "held", "held", "fit"):
        wl = fit_workload if which == "fit" else held_workload
        runs[which].append(backend.run(wl, warmup=not (runs["fit"] or runs["held"])))
    per_run = [step_samples(r, fit_workload) for r in runs["fit"]]
    samples = [x for s, _ in per_run for x in s]
    hw, fit = fit_hardware(model, samples, statistics.median(g for _, g in per_run))
    eng = backend.engine

    def replay(machine: Hardware):
        return simulate_like(runs["held"][0], held_workload, eng.config, model, machine, eng.num_blocks)

    sim = replay(hw)
    real = [q for r in runs["held"] for q in r.requests]
    comparison = compare(real, sim)
    # the measurement's resolution: the fit runs and the held-out runs measured twice, and the replay predicted
    # from each fit run alone; the widest of the three spreads
    spreads = [spread([metrics.summarize(r.requests) for r in runs[k]]) for k in ("held", "fit")]
    spreads.append(spread([replay(fit_hardware(model, s, g)[0]).summary() for s, g in per_run]))
    comparison.update({k: max(x[k] for x in spreads) for k in spreads[0]})
    return Calibration(hw, fit, comparison, sim, real)
