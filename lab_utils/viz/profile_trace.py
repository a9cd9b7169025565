"""A `torch.profiler` trace drawn as a timeline: a host row (the operators Python dispatched, outermost only)
and a device row (the kernels and copies the GPU ran). Gaps in the device row are time the GPU waited for the
host; on a CPU there is no device row and the host row is the work itself.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass

import plotly.graph_objects as go

HOST_CATS = {"cpu_op", "user_annotation"}
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
COLORS = {"host": "#636EFA", "device": "#EF553B"}


@dataclass(frozen=True)
class TraceEvent:
    row: str  # "host" | "device"
    name: str
    start_us: float  # since the trace's first event
    dur_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


def _outermost(events: list[dict]) -> list[dict]:
    """Events not inside another of the same thread (children of an operator are its own work)."""
    out, ends = [], {}
    for e in sorted(events, key=lambda e: (e["tid"], e["ts"], -e["dur"])):
        if e["ts"] + e["dur"] <= ends.get(e["tid"], float("-inf")):
            continue
        out.append(e)
        ends[e["tid"]] = e["ts"] + e["dur"]
    return out


def chrome_events(trace: dict) -> list[TraceEvent]:
    """The host and device rows of a Chrome-format trace (what `prof.export_chrome_trace` writes)."""
    complete = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "ts" in e]
    host = _outermost([e for e in complete if e.get("cat") in HOST_CATS])
    device = [e for e in complete if e.get("cat") in DEVICE_CATS]
    if not host and not device:
        return []
    t0 = min(float(e["ts"]) for e in host + device)
    return sorted([TraceEvent(row, e["name"], float(e["ts"]) - t0, float(e["dur"]))
                   for row, evs in (("host", host), ("device", device)) for e in evs], key=lambda e: e.start_us)


def trace_events(prof) -> list[TraceEvent]:
    """The rows of a finished `torch.profiler.profile` (exported to a temporary Chrome trace and read back)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            return chrome_events(json.load(f))
    finally:
        os.remove(path)


def rows(events: list[TraceEvent]) -> list[str]:
    """The rows that hold events, host first."""
    return [r for r in ("host", "device") if any(e.row == r for e in events)]


def busy_fraction(events: list[TraceEvent], row: str) -> float:
    """Share of the trace's span during which `row` is busy (its events' union); 1 - it is the row's idle gaps."""
    span = max((e.end_us for e in events), default=0.0) - min((e.start_us for e in events), default=0.0)
    spans = sorted((e.start_us, e.end_us) for e in events if e.row == row)
    busy, end = 0.0, float("-inf")
    for s, t in spans:
        if t > end:
            busy += t - max(s, end)
            end = t
    return busy / span if span > 0 else 0.0


def top_ops(events: list[TraceEvent], row: str, n: int = 5) -> list[tuple[str, float, int]]:
    """(name, total µs, count) of the `n` names that took most time on `row`."""
    total, count = Counter(), Counter()
    for e in events:
        if e.row == row:
            total[e.name] += e.dur_us
            count[e.name] += 1
    return [(name, us, count[name]) for name, us in total.most_common(n)]


def profile_timeline(events: list[TraceEvent], title: str = "One engine step") -> go.Figure:
    """Horizontal bars on a µs axis: one row for the host, one for the device (when it ran anything)."""
    if not events:
        raise ValueError("no host or device events in the trace: profile with activities=[ProfilerActivity.CPU] "
                         "(and CUDA on a GPU) around the step")
    fig = go.Figure()
    for row in rows(events):
        evs = [e for e in events if e.row == row]
        fig.add_bar(y=[row] * len(evs), x=[e.dur_us for e in evs], base=[e.start_us for e in evs],
                    orientation="h", name=row, marker_color=COLORS[row], marker_line_width=0,
                    hovertext=[f"{e.name}: {e.dur_us:.1f} µs" for e in evs], hoverinfo="text")
    fig.update_layout(title=title, barmode="overlay", height=260, xaxis_title="µs since the step began",
                      yaxis={"categoryorder": "array", "categoryarray": list(reversed(rows(events)))})
    return fig
