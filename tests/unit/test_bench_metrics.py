"""Serving metrics on hand-made timestamps, where every number can be checked by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lab_utils.bench import metrics
from lab_utils.bench.metrics import RequestTimes
from lab_utils.bench.report import format_table


def two_requests():
    # r1 arrives at 0, tokens at 1.0, 1.5, 2.5 ; r2 arrives at 1.0, one token at 1.2
    return [RequestTimes(0.0, [1.0, 1.5, 2.5], num_prompt_tokens=10), RequestTimes(1.0, [1.2], num_prompt_tokens=6)]


def test_per_request_definitions():
    r1, r2 = two_requests()
    assert metrics.ttft(r1) == 1.0 and metrics.ttft(r2) == pytest.approx(0.2)
    assert metrics.itls(r1) == [0.5, 1.0] and metrics.itls(r2) == []
    assert metrics.tpot(r1) == 0.75 and math.isnan(metrics.tpot(r2))
    assert metrics.e2el(r1) == 2.5 and metrics.e2el(r2) == pytest.approx(0.2)


def test_summary_values():
    s = metrics.summarize(two_requests())
    assert s["duration"] == 2.5 and s["completed"] == 2 and s["failed"] == 0
    assert s["total_output_tokens"] == 4 and s["total_input_tokens"] == 16
    assert s["output_throughput"] == pytest.approx(4 / 2.5)
    assert s["request_throughput"] == pytest.approx(2 / 2.5)
    assert s["total_token_throughput"] == pytest.approx(20 / 2.5)
    assert s["mean_ttft_ms"] == pytest.approx(600) and s["median_ttft_ms"] == pytest.approx(600)
    assert s["p99_ttft_ms"] == pytest.approx(200 + 0.99 * 800)
    assert s["p90_ttft_ms"] == pytest.approx(200 + 0.9 * 800)
    assert s["mean_tpot_ms"] == pytest.approx(750)  # the one-token request has no TPOT (as in vLLM)
    assert s["mean_itl_ms"] == pytest.approx(750) and s["p99_itl_ms"] == pytest.approx(500 + 0.99 * 500)
    assert s["median_e2el_ms"] == pytest.approx(1350)
    assert s["request_goodput"] is None and s["slo_attainment"] is None


def test_goodput_counts_requests_meeting_every_slo():
    reqs = two_requests()
    assert metrics.summarize(reqs, slo_ttft_ms=500)["request_goodput"] == pytest.approx(1 / 2.5)  # only r2
    assert metrics.summarize(reqs, slo_tpot_ms=700)["request_goodput"] == pytest.approx(1 / 2.5)  # r1's TPOT 750
    both = metrics.summarize(reqs, slo_ttft_ms=2000, slo_tpot_ms=800)
    assert both["request_goodput"] == pytest.approx(2 / 2.5) and both["slo_attainment"] == 1.0
    assert metrics.summarize(reqs, slo_ttft_ms=100)["request_goodput"] == 0.0


def test_explicit_duration_and_failed_requests():
    reqs = two_requests() + [RequestTimes(0.5, [])]  # e.g. aborted before its first token
    s = metrics.summarize(reqs, duration=4.0)
    assert s["completed"] == 2 and s["failed"] == 1 and s["output_throughput"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="none of the"):
        metrics.summarize([RequestTimes(0.0, [])])
    with pytest.raises(ValueError, match="duration"):
        metrics.summarize(two_requests(), duration=0.0)


def test_percentile_matches_numpy():
    xs = list(np.random.default_rng(0).exponential(size=101))
    for q in (50, 90, 99):
        assert metrics._percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_per_request_lists_and_table():
    d = metrics.per_request(two_requests())
    assert d["output_lens"] == [3, 1] and d["tpots"][1] is None and d["itls"] == [[0.5, 1.0], []]
    s = dict(metrics.summarize(two_requests(), slo_ttft_ms=500), backend="lab", config={"scheduler": "static"})
    table = format_table([s, dict(s, backend="hf", config={})], baseline="hf")
    assert "lab/static" in table and "output tok/s vs hf" in table and "1.00x" in table
    assert "1.60" in table  # output throughput
