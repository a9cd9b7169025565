"""Gantt chart of an engine run from `LLMEngine.step_log`: one row per request, one bar per stretch of steps."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import plotly.graph_objects as go

COLORS = {"prefill": "#EF553B", "decode": "#636EFA"}


@dataclass
class Segment:
    request_id: str
    kind: str  # "prefill" | "decode"
    first_step: int  # index in the step log
    last_step: int
    start: float  # seconds since the first step began (or step index, for x="step")
    end: float
    tokens: int


def timeline_segments(step_log: Sequence[Mapping], prompt_lens: Mapping[str, int] | None = None,
                      x: str = "time") -> list[Segment]:
    """Merge each request's consecutive steps of one kind into segments. A step computes prompt tokens
    (prefill) until the request has computed `prompt_lens[id]` tokens; without `prompt_lens`, a step of more
    than one token counts as prefill. `x`: "time" (seconds since the first step) or "step" (step index)."""
    if x not in ("time", "step"):
        raise ValueError(f"x={x!r} is invalid: must be 'time' or 'step'")
    if not step_log:
        return []
    t0 = step_log[0]["start"]
    done: dict[str, int] = {}
    open_seg: dict[str, Segment] = {}
    segs: list[Segment] = []
    for i, step in enumerate(step_log):
        for rid in step.get("preempted", []):
            done[rid] = 0  # recompute preemption: its prompt runs again
        start, end = (step["start"] - t0, step["end"] - t0) if x == "time" else (i, i + 1)
        for rid, n in step["requests"]:
            if prompt_lens is not None and rid in prompt_lens:
                kind = "prefill" if done.get(rid, 0) < prompt_lens[rid] else "decode"
            else:
                kind = "prefill" if n > 1 else "decode"
            done[rid] = done.get(rid, 0) + n
            seg = open_seg.get(rid)
            if seg is not None and seg.kind == kind and seg.last_step == i - 1:
                seg.last_step, seg.end, seg.tokens = i, end, seg.tokens + n
            else:
                seg = Segment(str(rid), kind, i, i, start, end, n)
                segs.append(seg)
                open_seg[rid] = seg
    return segs


def timeline(step_log: Sequence[Mapping], prompt_lens: Mapping[str, int] | None = None, x: str = "time",
             title: str = "Which request ran in which step", height: int | None = None) -> go.Figure:
    """Rows = requests (in order of first appearance), bars = stretches of consecutive steps, red = prefill,
    blue = decode. Gaps in a row are steps the request waited (queued, or stalled by someone's prefill)."""
    segs = timeline_segments(step_log, prompt_lens, x)
    order = list(dict.fromkeys(s.request_id for s in segs))
    scale = 1e3 if x == "time" else 1
    fig = go.Figure()
    for kind in ("prefill", "decode"):
        ks = [s for s in segs if s.kind == kind]
        fig.add_bar(
            name=kind, orientation="h", y=[s.request_id for s in ks], base=[s.start * scale for s in ks],
            x=[max((s.end - s.start) * scale, 1e-9) for s in ks], marker_color=COLORS[kind],
            customdata=[[s.first_step, s.last_step, s.tokens] for s in ks],
            hovertemplate="request %{y}<br>steps %{customdata[0]}–%{customdata[1]}, %{customdata[2]} tokens<extra>" + kind + "</extra>",
        )
    fig.update_layout(title=title, barmode="overlay", height=height or 120 + 18 * len(order),
                      xaxis_title="ms since the first step" if x == "time" else "engine step",
                      yaxis=dict(title="request", categoryorder="array", categoryarray=order[::-1], type="category"))
    return fig
