"""Negative controls for lab 16's claims: good measurements pass, each perturbed one fails its own claim. And the
measurements the claims read, produced for real on small shapes: the arithmetic, a fraction of the bound, a
profiler trace of an engine step."""
from __future__ import annotations

import copy

import pytest
import torch

from lab_utils.checks import lab16
from lab_utils.kernels import decode_bench


def good() -> dict:
    return dict(tokens_equal=True, kernel_calls=4, bound_fraction={"yours": 3e-5, "engine": 0.1, "sdpa_dense": 0.16},
                bytes_per_flop=0.667, ridge_bytes_per_flop=0.05, trace_rows=["host"],
                bench_line={"correct": True, "us_per_call": 7e4, "device": "cpu", "error": None})


def test_good_measurements_pass(capsys):
    lab16.assert_claims(good())
    assert "FAIL" not in capsys.readouterr().out


@pytest.mark.parametrize("key, value, message", [
    ("tokens_equal", False, "greedy tokens with your kernel"),
    ("kernel_calls", 0, "greedy tokens with your kernel"),
    ("ridge_bytes_per_flop", 0.9, "bound by bytes"),
    ("bound_fraction", {"yours": 3e-5, "engine": 1.4, "sdpa_dense": 0.16}, "under the KV-bytes bound"),
    ("bound_fraction", {"yours": 0.0, "engine": 0.1, "sdpa_dense": 0.16}, "under the KV-bytes bound"),
    ("trace_rows", [], "profiler trace"),
    ("trace_rows", ["device"], "profiler trace"),
    ("bench_line", {"correct": False, "error": "AssertionError: values differ"}, "bench-kernel"),
    ("bench_line", None, "bench-kernel"),
])
def test_each_claim_fails_on_its_wrong_measurement(key, value, message):
    r = copy.deepcopy(good())
    r[key] = value
    with pytest.raises(AssertionError) as err:
        lab16.assert_claims(r, show=False)
    assert message in str(err.value) and "1 of 5 claims failed" in str(err.value), str(err.value)


def test_a_missing_measurement_is_named():
    r = good()
    del r["bench_line"]
    with pytest.raises(KeyError, match="bench_line"):
        lab16.assert_claims(r)


def test_decode_arithmetic():
    s = decode_bench.DecodeShape(batch=2, context=100, q_heads=9, kv_heads=3, head_dim=64, dtype="bfloat16")
    assert s.kv_bytes == 2 * 2 * 100 * 3 * 64 * 2 and s.flops == 4 * 2 * 100 * 9 * 64
    assert s.bytes_per_flop == pytest.approx(2 * 3 * 2 / (4 * 9))  # independent of batch and context
    with pytest.raises(ValueError, match="share"):
        decode_bench.DecodeShape(1, 10, q_heads=9, kv_heads=2)
    with pytest.raises(ValueError, match="dtype"):
        decode_bench.DecodeShape(1, 10, dtype="float33")


def test_every_path_computes_the_reference_attention():
    """The three timed paths compute the same attention as `paged_attention_reference` (a wrong one would make
    the side-by-side meaningless)."""
    case = decode_bench.paged_case(decode_bench.DecodeShape(3, 70, 4, 2, 16, block_size=8), "cpu", seed=1)
    want = case.expected()
    assert torch.allclose(decode_bench.engine_call(case, "sdpa")()[0], want, atol=1e-5)
    assert torch.allclose(decode_bench.sdpa_dense_call(case)()[:, :, 0], want, atol=1e-5)
    from tests.unit.test_checks_lab16 import loop_kernel

    assert torch.allclose(decode_bench.kernel_call(loop_kernel(), case)(), want, atol=1e-5)


def test_a_slow_path_is_a_small_fraction_and_the_bound_is_measured():
    import time

    def slow(case):
        return lambda: time.sleep(0.01)

    shape = decode_bench.DecodeShape(1, 64, 4, 2, 16, block_size=16)
    (t,) = decode_bench.measure({"slow": slow}, shape, torch.device("cpu"), repeats=2)
    assert t.us >= 1e4 and 0 < t.fraction < 0.1 and t.bound_us > 0


def test_profile_timeline_of_an_engine_step():
    from torch.profiler import ProfilerActivity, profile

    from lab_utils import LLMEngine, SamplingParams
    from lab_utils.engine.config import EngineConfig
    from lab_utils.models.loader import build_random
    from lab_utils.models.registry import REGISTRY
    from lab_utils.viz import profile_trace

    model = build_random(REGISTRY["tiny-random"].config, seed=0).eval()
    engine = LLMEngine(model, EngineConfig(block_size=4, num_gpu_blocks=32), dtype=torch.float32)
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    events = profile_trace.trace_events(prof)
    assert profile_trace.rows(events) == ["host"]
    assert all(e.dur_us >= 0 and e.start_us >= 0 for e in events)
    assert 0 < profile_trace.busy_fraction(events, "host") <= 1
    assert profile_trace.top_ops(events, "host", 3)
    fig = profile_trace.profile_timeline(events)
    assert [bar.name for bar in fig.data] == ["host"]
    with pytest.raises(ValueError, match="no host or device events"):
        profile_trace.profile_timeline([])


def test_trace_rows_from_a_chrome_trace():
    """Host: the outermost operators only; device: kernels and copies; times from the first event."""
    from lab_utils.viz import profile_trace

    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 100, "dur": 50, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": 110, "dur": 30, "tid": 1},  # inside linear
        {"ph": "X", "cat": "cpu_op", "name": "aten::softmax", "ts": 200, "dur": 10, "tid": 1},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 160, "dur": 20, "tid": 7},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 120, "dur": 5, "tid": 1},
        {"ph": "i", "cat": "cpu_op", "name": "mark", "ts": 90, "tid": 1},
    ]}
    events = profile_trace.chrome_events(trace)
    assert [(e.row, e.name, e.start_us) for e in events] == [
        ("host", "aten::linear", 0.0), ("device", "gemm", 60.0), ("host", "aten::softmax", 100.0)]
    assert profile_trace.rows(events) == ["host", "device"]
    assert profile_trace.busy_fraction(events, "device") == pytest.approx(20 / 110)
    assert profile_trace.busy_fraction(events, "host") == pytest.approx(60 / 110)
