"""Plotly figures of the course, one small function each (they return a `go.Figure`; call `.show()`).

- `timeline(step_log)`: which request ran in which engine step, prefill vs decode (a Gantt chart).
- `latency_cdf(runs, metric)`: empirical CDFs of TTFT / ITL / TPOT / E2E latency, one curve per run.
- `throughput_bars(results)`: output (or any) throughput per run, side by side.
- `profile_trace.profile_timeline(events)`: a `torch.profiler` trace of one step, host row and device row.
"""
from lab_utils.viz.latency import latency_cdf, throughput_bars
from lab_utils.viz.timeline import timeline, timeline_segments

__all__ = ["timeline", "timeline_segments", "latency_cdf", "throughput_bars"]
