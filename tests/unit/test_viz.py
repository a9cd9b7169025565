"""Figures: the timeline's segments are computed right; every figure has the traces it promises."""
from __future__ import annotations

from types import SimpleNamespace

import plotly.graph_objects as go
import pytest

from lab_utils.bench.metrics import RequestTimes, per_request
from lab_utils.viz import latency_cdf, throughput_bars, timeline, timeline_segments


def step_log():
    # request a: prompt 4 (prefill in 2 chunks) then 2 decodes; b joins at step 2 with a 3-token prompt
    steps = [[("a", 2)], [("a", 2)], [("b", 3)], [("a", 1), ("b", 1)], [("a", 1)]]
    return [dict(start=10.0 + i, end=10.5 + i, requests=r, preempted=[]) for i, r in enumerate(steps)]


def test_segments_merge_consecutive_steps_of_one_kind():
    segs = timeline_segments(step_log(), prompt_lens={"a": 4, "b": 3})
    got = [(s.request_id, s.kind, s.first_step, s.last_step, s.tokens) for s in segs]
    assert got == [("a", "prefill", 0, 1, 4), ("b", "prefill", 2, 2, 3), ("a", "decode", 3, 4, 2),
                   ("b", "decode", 3, 3, 1)]
    assert segs[0].start == 0.0 and segs[0].end == 1.5  # seconds since the first step
    by_step = timeline_segments(step_log(), x="step")
    assert by_step[0].start == 0 and by_step[0].end == 2
    # without prompt lengths: a multi-token step is prefill, a one-token step decode
    assert [s.kind for s in by_step] == ["prefill", "prefill", "decode", "decode"]
    with pytest.raises(ValueError):
        timeline_segments(step_log(), x="tokens")


def test_timeline_figure():
    fig = timeline(step_log(), prompt_lens={"a": 4, "b": 3})
    assert isinstance(fig, go.Figure) and [t.name for t in fig.data] == ["prefill", "decode"]
    assert len(fig.data[0].y) == 2 and len(fig.data[1].y) == 2
    assert list(fig.data[1].base) == [3000.0, 3000.0]  # ms since the first step
    assert timeline([]).data[0].y == ()


def test_latency_cdf_from_runs_and_json():
    reqs = [RequestTimes(0.0, [0.1, 0.3]), RequestTimes(0.0, [0.2, 0.25, 0.45])]
    run = SimpleNamespace(requests=reqs)
    fig = latency_cdf({"a": run, "b": per_request(reqs)}, "ttft")
    assert len(fig.data) == 2
    assert list(fig.data[0].x) == pytest.approx([100.0, 200.0]) and list(fig.data[0].y) == [0.5, 1.0]
    assert list(fig.data[1].x) == pytest.approx([100.0, 200.0])
    itl = latency_cdf({"a": run}, "itl")
    assert list(itl.data[0].x) == pytest.approx([50.0, 200.0, 200.0])
    with pytest.raises(ValueError):
        latency_cdf({"a": run}, "latency")


def test_throughput_bars():
    fig = throughput_bars({"static": {"output_throughput": 10.0}, "continuous": {"output_throughput": 25.0}})
    assert list(fig.data[0].x) == ["static", "continuous"] and list(fig.data[0].y) == [10.0, 25.0]
