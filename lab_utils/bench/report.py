"""One table for several benchmark results (dicts from `BenchRun.summary` or saved JSON files)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping, Sequence

# (key, row title, format)
DEFAULT_ROWS = [
    ("completed", "completed requests", "{:.0f}"),
    ("duration", "duration (s)", "{:.2f}"),
    ("output_throughput", "output tok/s", "{:.2f}"),
    ("total_token_throughput", "total tok/s", "{:.2f}"),
    ("request_throughput", "requests/s", "{:.3f}"),
    ("request_goodput", "goodput (req/s)", "{:.3f}"),
    ("median_ttft_ms", "median TTFT (ms)", "{:.1f}"),
    ("p99_ttft_ms", "p99 TTFT (ms)", "{:.1f}"),
    ("median_tpot_ms", "median TPOT (ms)", "{:.1f}"),
    ("p99_tpot_ms", "p99 TPOT (ms)", "{:.1f}"),
    ("median_itl_ms", "median ITL (ms)", "{:.1f}"),
    ("p99_itl_ms", "p99 ITL (ms)", "{:.1f}"),
    ("median_e2el_ms", "median E2E (ms)", "{:.1f}"),
    ("p99_e2el_ms", "p99 E2E (ms)", "{:.1f}"),
]


def label(result: Mapping) -> str:
    """`lab/continuous`, `lab/static`, `hf`, ...: the backend plus the scheduler when there is one."""
    sched = (result.get("config") or {}).get("scheduler")
    return f"{result.get('backend', '?')}/{sched}" if sched else str(result.get("backend", "?"))


def _fmt(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def format_table(results: Sequence[Mapping] | Mapping[str, Mapping], rows=DEFAULT_ROWS,
                 baseline: str | None = None) -> str:
    """Rows = metrics, columns = results. With `baseline` (a column name), adds an `output tok/s vs <baseline>`
    row: the ratio every claim of the course is about."""
    cols = dict(results) if isinstance(results, Mapping) else {label(r): r for r in results}
    names = list(cols)
    width = max([12] + [len(n) + 2 for n in names])
    title = max(len(t) for _, t, _ in rows) + 2
    lines = [" " * title + "".join(f"{n:>{width}}" for n in names)]
    for key, text, fmt in rows:
        if not any(key in r for r in cols.values()):
            continue
        lines.append(f"{text:<{title}}" + "".join(f"{_fmt(cols[n].get(key), fmt):>{width}}" for n in names))
    if baseline is not None:
        if baseline not in cols:
            raise ValueError(f"baseline {baseline!r} is not one of the columns {names}")
        base = cols[baseline]["output_throughput"]
        lines.append(f"{'output tok/s vs ' + baseline:<{title}}"
                     + "".join(f"{cols[n]['output_throughput'] / base:>{width - 1}.2f}x" for n in names))
    return "\n".join(lines)


def load_results(paths: Sequence[str | Path]) -> list[dict]:
    return [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths]
