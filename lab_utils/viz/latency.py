"""Latency CDFs and throughput bars for benchmark runs (`BenchRun`s, or result dicts saved by `bench --json`)."""
from __future__ import annotations

from typing import Mapping

import plotly.graph_objects as go

from lab_utils.bench import metrics

_FROM_REQUESTS = {"ttft": lambda rs: [metrics.ttft(r) for r in rs],
                  "itl": lambda rs: [x for r in rs for x in metrics.itls(r)],
                  "tpot": lambda rs: [metrics.tpot(r) for r in rs if len(r.token_times) > 1],
                  "e2el": lambda rs: [metrics.e2el(r) for r in rs]}
_FROM_JSON = {"ttft": "ttfts", "itl": "itls", "tpot": "tpots", "e2el": "e2els"}
_NAMES = {"ttft": "TTFT", "itl": "inter-token latency", "tpot": "TPOT", "e2el": "end-to-end latency"}


def latency_values_ms(run, metric: str) -> list[float]:
    """Sorted values in ms of one metric for a `BenchRun` (or anything with `.requests`) or a detailed JSON dict."""
    if metric not in _FROM_REQUESTS:
        raise ValueError(f"metric={metric!r} is invalid: must be one of {sorted(_FROM_REQUESTS)}")
    if isinstance(run, Mapping):
        raw = run.get(_FROM_JSON[metric])
        if raw is None:
            raise ValueError(f"this result has no {_FROM_JSON[metric]!r}: save it with per-request details")
        vals = [x for per in raw for x in per] if metric == "itl" else [x for x in raw if x is not None]
    else:
        done = [r for r in run.requests if r.token_times]
        vals = _FROM_REQUESTS[metric](done)
    return sorted(v * 1e3 for v in vals)


def latency_cdf(runs: Mapping[str, object], metric: str = "ttft", title: str | None = None) -> go.Figure:
    """One empirical CDF per run: x = latency (ms), y = share of requests (or gaps, for ITL) at or below it."""
    fig = go.Figure()
    for name, run in runs.items():
        xs = latency_values_ms(run, metric)
        n = len(xs)
        fig.add_scatter(x=xs, y=[(i + 1) / n for i in range(n)], mode="lines", name=name, line_shape="hv")
    fig.update_layout(title=title or f"CDF of {_NAMES[metric]}", xaxis_title=f"{_NAMES[metric]} (ms)",
                      yaxis=dict(title="fraction ≤ x", range=[0, 1.02]))
    return fig


def throughput_bars(results: Mapping[str, Mapping], key: str = "output_throughput", title: str | None = None) -> go.Figure:
    """Bars of `key` (default output tokens/s) per result dict, labelled with the value."""
    names = list(results)
    vals = [results[n][key] for n in names]
    fig = go.Figure(go.Bar(x=names, y=vals, text=[f"{v:.1f}" for v in vals], textposition="outside"))
    fig.update_layout(title=title or key.replace("_", " "), yaxis_title=key, xaxis_title="run")
    return fig
