"""The simulator: datasheet specs, the roofline cost model, the discrete-event cluster that drives the engine's
own Scheduler/BlockManager (every request finishes, every block comes back), and the calibration fit."""
from __future__ import annotations

import math

import pytest

from lab_utils import EngineConfig, load_model
from lab_utils.bench.backends import LabBackend
from lab_utils.bench.workload import make_workload
from lab_utils.sim import GPUS, Hardware, allreduce_time, gpu, kv_capacity, model_spec, step_cost
from lab_utils.sim.calibrate import StepSample, compare, fit_hardware, spread, step_samples
from lab_utils.sim.cost_model import ModelSpec, causal_pairs, max_concurrent_seqs
from lab_utils.sim.gpus import cpu_hardware
from lab_utils.sim.simulator import (SimEngine, goodput_at_attainment, kv_transfer_time, make_engine,
                                     roofline_step_time, simulate, simulate_disaggregated, synthetic_requests)

H100 = gpu("H100")
L8B = model_spec("llama-3-8b")


# --------------------------------------------------------------------------------------------- specs
def test_gpu_specs_have_sources_and_sane_numbers():
    assert {"A100-80GB-SXM", "H100-SXM", "H200-SXM", "L4"} <= set(GPUS)
    for hw in GPUS.values():
        assert hw.source.startswith("https://www.nvidia.com/")
        assert 1e13 < hw.peak_flops < 2e15 and 1e11 < hw.mem_bw < 1e13
    assert gpu("h200").mem_bytes > gpu("H100").mem_bytes and gpu("H200").mem_bw > H100.mem_bw
    assert gpu("L4").link_bw < H100.link_bw  # PCIe vs NVLink


def test_bad_hardware_and_names_raise():
    with pytest.raises(ValueError, match="unknown GPU"):
        gpu("B9000")
    with pytest.raises(ValueError, match="peak_flops"):
        Hardware("x", 0, 1, 1, 1)
    with pytest.raises(ValueError, match="unknown model"):
        model_spec("gpt-5")
    with pytest.raises(ValueError, match="tp=0"):
        step_cost(L8B, H100, [(0, 4)], tp=0)


def test_model_shapes_match_published_sizes_and_the_engine():
    assert model_spec("llama-3-8b").params == pytest.approx(8.03e9, rel=0.01)
    assert model_spec("llama-3-70b").params == pytest.approx(70.6e9, rel=0.01)
    assert L8B.kv_bytes_per_token == 128 * 1024  # 2 x 32 layers x 8 heads x 128 x 2 bytes
    model, _ = load_model("tiny-random", device="cpu")
    spec = ModelSpec.from_config("tiny", model.config, dtype_bytes=4)
    n_real = sum(p.numel() for p in model.parameters())
    assert spec.params == n_real
    from lab_utils.engine.kv.paging import bytes_per_token
    c = model.config
    assert spec.kv_bytes_per_token == bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                                                      model.dtype)


# --------------------------------------------------------------------------------------------- cost model
def test_decode_is_memory_bound_prefill_compute_bound():
    dec = step_cost(L8B, H100, [(512, 1)] * 8)
    pre = step_cost(L8B, H100, [(0, 2048)])
    assert dec.bound == "memory" and pre.bound == "compute"
    assert dec.memory_s == pytest.approx(dec.bytes / H100.mem_bw)
    # a decode step reads every weight once (the input embedding only in the rows it gathers)
    assert dec.bytes >= L8B.weight_bytes - L8B.embed_params * L8B.dtype_bytes
    assert pre.flops > 2 * L8B.num_layers * L8B.layer_params * 2048  # + attention + one LM-head row
    assert dec.intensity < H100.ridge_flops_per_byte < pre.intensity


def test_causal_pairs():
    assert causal_pairs(0, 1) == 1 and causal_pairs(0, 3) == 6 and causal_pairs(10, 1) == 11


def test_allreduce_and_tensor_parallel():
    assert allreduce_time(1e6, 1, 1e9) == 0.0
    assert allreduce_time(1e6, 2, 1e9) == pytest.approx(1e-3)  # 2*(1/2)*1e6/1e9
    assert allreduce_time(1e6, 8, 1e9, 1e-5) == pytest.approx(2 * 7 / 8 * 1e-3 + 1e-5)
    one = step_cost(L8B, H100, [(512, 1)] * 16)
    two = step_cost(L8B, H100, [(512, 1)] * 16, tp=2)
    assert two.memory_s == pytest.approx(one.memory_s / 2, rel=0.05)
    assert two.comm_s > 0 and one.comm_s == 0
    assert two.time_s < one.time_s


def test_pipeline_bubble():
    pp = step_cost(L8B, H100, [(512, 1)] * 16, pp=2)
    assert pp.bubble_s > 0
    one_mb = step_cost(L8B, H100, [(512, 1)], pp=4)  # one sequence: nothing to overlap, 3 idle slots of 4
    assert one_mb.bubble_s == pytest.approx(3 / 4 * (one_mb.time_s - one_mb.overhead_s), rel=1e-6)


def test_kv_capacity_second_gpu_more_than_doubles():
    one, two = kv_capacity(L8B, H100, 1), kv_capacity(L8B, H100, 2)
    assert two["kv_tokens"] > 2 * one["kv_tokens"]  # weights are paid once, not twice
    assert max_concurrent_seqs(L8B, H100, 8192, 2) > 2 * max_concurrent_seqs(L8B, H100, 8192, 1)
    assert not kv_capacity(model_spec("llama-3-70b"), H100, 1)["fits"]
    assert kv_capacity(model_spec("llama-3-70b"), H100, 2)["fits"]
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_capacity(L8B, H100, 1, gpu_memory_utilization=1.5)


# --------------------------------------------------------------------------------------------- simulator
def _cfg(**kw):
    base = dict(max_num_seqs=32, max_num_batched_tokens=512, enable_prefix_caching=False)
    base.update(kw)
    return EngineConfig(**base)


def _check_done(res, reqs):
    by = {t.request_id: t for t in res.timelines}
    for r in reqs:
        t = by[r.request_id]
        assert len(t.token_times) == r.output_len, r.request_id
        assert t.token_times == sorted(t.token_times) and t.token_times[0] > t.arrival_time
    res.check_all_free()


def test_simulate_colocated_finishes_everything_and_is_deterministic():
    reqs = synthetic_requests(30, 200, 20, request_rate=20.0, seed=3)
    runs = [simulate(reqs, [make_engine(L8B, H100, _cfg(), name=f"e{i}") for i in range(2)]) for _ in range(2)]
    _check_done(runs[0], reqs)
    s0, s1 = runs[0].summary(), runs[1].summary()
    assert s0["mean_ttft_ms"] == s1["mean_ttft_ms"] and s0["completed"] == 30
    assert all(0 < u <= 1 for u in s0["utilization"])


def test_simulator_uses_the_real_scheduler_policies():
    reqs = synthetic_requests(16, 64, 32, request_rate=math.inf, seed=0, output_dist="longtail")
    static = simulate(reqs, [make_engine(L8B, H100, _cfg(scheduler="static", max_num_seqs=4))]).summary()
    cont = simulate(reqs, [make_engine(L8B, H100, _cfg(scheduler="continuous", max_num_seqs=4))]).summary()
    assert cont["duration"] < static["duration"]  # continuous batching refills freed slots (lab 01)


def test_small_pool_preempts_but_finishes():
    reqs = synthetic_requests(12, 64, 64, request_rate=math.inf, seed=1, range_ratio=0.0)
    eng = SimEngine(_cfg(block_size=16), num_blocks=24, step_time=roofline_step_time(L8B, H100))
    res = simulate(reqs, [eng])
    _check_done(res, reqs)
    assert res.summary()["num_preemptions"] > 0


def test_too_long_request_is_rejected_not_lost():
    reqs = synthetic_requests(2, 64, 8, request_rate=math.inf, seed=1, range_ratio=0.0)
    reqs[1].prompt_token_ids = reqs[1].prompt_token_ids * 20
    eng = SimEngine(_cfg(block_size=16), num_blocks=10, step_time=roofline_step_time(L8B, H100))
    res = simulate(reqs, [eng])
    assert len(eng.rejected) == 1 and res.summary()["completed"] == 1


def test_disaggregated_moves_kv_and_finishes_everything():
    reqs = synthetic_requests(20, 300, 16, request_rate=10.0, seed=4)
    xfer = kv_transfer_time(L8B, H100.link_bw, H100.link_latency_s)
    P = [make_engine(L8B, H100, _cfg(scheduler="continuous", enable_chunked_prefill=False, max_num_batched_tokens=4096))]
    D = [make_engine(L8B, H100, _cfg())]
    res = simulate_disaggregated(reqs, P, D, xfer, kv_bytes=lambda n: n * L8B.kv_bytes_per_token)
    _check_done(res, reqs)
    assert res.kv_transfers == 20 and res.kv_bytes == sum(r.input_len for r in reqs) * L8B.kv_bytes_per_token
    assert all(t.kv_transfer_s == pytest.approx(xfer(t.num_prompt_tokens)) for t in res.timelines)
    # the decode pool never computes a prompt: its steps are one token per sequence
    assert all(s["num_tokens"] == s["num_seqs"] for s in D[0].step_log)
    assert xfer(1000) == pytest.approx(1000 * L8B.kv_bytes_per_token / H100.link_bw + H100.link_latency_s)


def test_goodput_at_attainment_picks_highest_passing_rate():
    table = {1.0: 1.0, 2.0: 0.95, 3.0: 0.5}
    best, rows = goodput_at_attainment(lambda r: dict(slo_attainment=table[r], mean_ttft_ms=0, mean_tpot_ms=0,
                                                      p90_ttft_ms=0, p90_tpot_ms=0, output_throughput=0),
                                       [3.0, 1.0, 2.0])
    assert best == 2.0 and [r["rate"] for r in rows] == [1.0, 2.0, 3.0]


def test_bad_simulation_inputs_raise():
    with pytest.raises(ValueError, match="requests is empty"):
        simulate([], [make_engine(L8B, H100, _cfg())])
    with pytest.raises(ValueError, match="does not fit"):
        make_engine(model_spec("llama-3-70b"), H100, _cfg())
    with pytest.raises(ValueError, match="link_bw"):
        kv_transfer_time(L8B, 0)


# --------------------------------------------------------------------------------------------- calibration
def test_fit_recovers_a_known_machine():
    spec = model_spec("smollm2-135m")
    true = cpu_hardware(40e9, 12e9, 0.02, 0.004)
    shapes = [[(0, 128)], [(0, 64), (70, 1)], [(0, 256)]] + [[(100 + i, 1)] * k for i in range(3) for k in (1, 2, 4, 8, 16)]
    samples = [StepSample(b, len(b), step_cost(spec, true, b).time_s) for b in shapes]
    hw, rep = fit_hardware(spec, samples)
    assert rep["step_mean_rel_err"] < 0.02
    for b in shapes:  # the fitted machine predicts every step it saw
        assert step_cost(spec, hw, b).time_s == pytest.approx(step_cost(spec, true, b).time_s, rel=0.03)
    with pytest.raises(ValueError, match=">= 4"):
        fit_hardware(spec, samples[:2])


def test_step_samples_replay_a_real_run_and_sim_compares():
    model, tok = load_model("tiny-random", device="cpu")
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, enable_prefix_caching=False, num_gpu_blocks=64)
    be = LabBackend((model, tok), cfg, device="cpu")
    wl = make_workload(tok, 4, 40, 5, input_dist="uniform", length_dist="uniform", seed=0)
    run = be.run(wl)
    samples, gap = step_samples(run, wl)
    assert sum(n for s in samples for _, n in s.batch) == sum(w.input_len + w.output_len - 1 for w in wl.requests)
    assert sum(s.num_sampled for s in samples) == sum(wl.output_lens) and gap >= 0
    spec = ModelSpec.from_config("tiny", model.config, dtype_bytes=4)
    hw, _ = fit_hardware(spec, samples)
    from lab_utils.sim.calibrate import simulate_like
    sim = simulate_like(run, wl, cfg, spec, hw, be.engine.num_blocks)
    cmp = compare(run.requests, sim)
    assert set(cmp) >= {"rel_err_ttft", "rel_err_tpot", "max_rel_err"} and cmp["max_rel_err"] >= 0


def test_spread_is_how_far_repeats_lie_apart_relative_to_their_mean():
    got = spread([{"mean_ttft_ms": 90.0, "mean_tpot_ms": 20.0}, {"mean_ttft_ms": 110.0, "mean_tpot_ms": 20.0}])
    assert got == pytest.approx({"spread_ttft": 0.2, "spread_tpot": 0.0})
