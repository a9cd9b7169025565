"""Execute the labs with papermill: a progress bar, a summary table, an HTML report, non-zero exit on failure.

    python -m lab_utils run-labs [--smoke] [--device auto|cpu|cuda] [--only 03] [--out DIR]

Every `labs/NN_*.ipynb` runs in a fresh kernel with the parameters `SMOKE`, `DEVICE` and `INTERACTIVE=False`
(`lab_parameters`) injected after its `parameters` cell, which declares them, and `LAB_SMOKE` / `LAB_INTERACTIVE=0`
set in the kernel's environment too (the labs read both: `lab_utils/params.py`). Written to `--out` (default
`out/labs`):

- `NN_name.ipynb`: each executed notebook (with its error, if it failed);
- `report.html`: one row per lab (status, seconds, key measured figures, link to the executed notebook);
- `summary.json`: the same as data.

Key figures: a lab that leaves a dict named `RESULTS` (figure name -> number or short text) in its namespace
gets it in the report; for a lab without one, the report shows the text of its last output instead
(docs/AUTHORING.md, "What the lab measured").
"""
from __future__ import annotations

import argparse
import datetime as _dt
import html
import json
import os
import platform
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lab_utils.paths import REPO_ROOT

LABS_DIR = REPO_ROOT / "labs"
DEFAULT_OUT = REPO_ROOT / "out" / "labs"
RESULTS_VAR = "RESULTS"
RESULTS_MARK = "<<<LAB_RESULTS>>>"
RUNNER_TAG = "lab-runner-results"
_RESULTS_CELL = f"""\
# added by `python -m lab_utils run-labs` to read the lab's {RESULTS_VAR} dict for its report; not part of the lab
import json as _lab_runner_json
if isinstance(globals().get({RESULTS_VAR!r}), dict):
    print({RESULTS_MARK!r} + _lab_runner_json.dumps({{str(k): v for k, v in {RESULTS_VAR}.items()}}, default=str))
"""


@dataclass
class LabResult:
    lab: str  # file stem, e.g. "00_foundations"
    title: str
    status: str  # "passed" | "failed"
    seconds: float
    notebook: str  # executed notebook, relative to the output folder
    results: dict[str, Any] = field(default_factory=dict)
    results_source: str = "none"  # "RESULTS" | "last output" | "none"
    last_output: str = ""
    error: str = ""
    failed_cell: int | None = None
    html: str | None = None  # rendered notebook, when --html-notebooks

    @property
    def ok(self) -> bool:
        return self.status == "passed"


# --------------------------------------------------------------------------------------------- discovery
def discover_labs(labs_dir: Path = LABS_DIR, only: list[str] | None = None) -> list[Path]:
    """`labs/*.ipynb` in name order; `only` keeps labs whose number or name matches ("3", "03", "03_chunked")."""
    labs = sorted(p for p in Path(labs_dir).glob("*.ipynb") if not p.name.startswith("."))
    if not only:
        return labs
    wanted = [w.strip() for item in only for w in item.split(",") if w.strip()]
    picked = []
    for p in labs:
        num = p.stem.split("_", 1)[0]
        for w in wanted:
            if p.stem == w or p.name == w or p.stem.startswith(w + "_") or (w.isdigit() and num.isdigit()
                                                                             and int(num) == int(w)):
                picked.append(p)
                break
    return picked


def notebook_title(nb) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return ""


# ------------------------------------------------------------------------------------- reading results
def _output_text(out) -> str:
    if out.get("output_type") == "stream":
        return out.get("text", "")
    if out.get("output_type") in ("execute_result", "display_data"):
        data = out.get("data", {})
        if "application/vnd.jupyter.widget-view+json" in data:
            return ""
        for mime in ("text/markdown", "text/plain"):
            if mime in data:
                text = data[mime]
                return "".join(text) if isinstance(text, list) else text
    return ""


def last_output_text(nb, limit: int = 1500) -> str:
    """Text of the last code cell that printed something (plots and widgets have no text and are skipped)."""
    for cell in reversed(nb.cells):
        if cell.cell_type != "code" or RUNNER_TAG in cell.metadata.get("tags", []):
            continue
        text = "".join(_output_text(o) for o in cell.get("outputs", [])).strip()
        if text:
            return text if len(text) <= limit else text[:limit] + " …"
    return ""


def extract_results(nb) -> tuple[dict[str, Any], bool]:
    """(the lab's RESULTS dict as printed by the runner's cell, whether it was found)."""
    for cell in nb.cells:
        if RUNNER_TAG not in cell.metadata.get("tags", []):
            continue
        for out in cell.get("outputs", []):
            text = _output_text(out)
            for line in text.splitlines():
                if line.startswith(RESULTS_MARK):
                    return json.loads(line[len(RESULTS_MARK):]), True
    return {}, False


# ------------------------------------------------------------------------------------------- execution
def lab_parameters(smoke: bool, device: str = "auto") -> dict[str, Any]:
    """What run-labs passes to every lab through papermill; each lab's `parameters` cell declares these names."""
    return {"SMOKE": smoke, "DEVICE": device, "INTERACTIVE": False}


def run_lab(path: Path, out_dir: Path, *, smoke: bool, device: str = "auto", timeout: float | None = None,
            kernel: str = "python3", html_notebook: bool = False, log_output: bool = False) -> LabResult:
    """Execute one lab into `out_dir` and describe how it went (never raises for a failing lab)."""
    import nbformat
    import papermill as pm

    path = Path(path).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    out_nb = out_dir / path.name
    out_nb.unlink(missing_ok=True)  # never report figures from a previous run
    stale_html = out_nb.with_suffix(".html")
    stale_html.unlink(missing_ok=True)
    nb = nbformat.read(path, as_version=4)
    title = notebook_title(nb)
    cell = nbformat.v4.new_code_cell(_RESULTS_CELL)
    cell.metadata["tags"] = [RUNNER_TAG]
    nb.cells.append(cell)

    env = {"LAB_SMOKE": "1" if smoke else "0", "LAB_INTERACTIVE": "0", "LAB_DEVICE": device,
           "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
           "TRANSFORMERS_OFFLINE": os.environ.get("TRANSFORMERS_OFFLINE", "1")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    error, failed_cell = "", None
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / path.name
            nbformat.write(nb, src)
            pm.execute_notebook(
                str(src), str(out_nb), parameters=lab_parameters(smoke, device),
                cwd=str(path.parent), kernel_name=kernel, language="python", progress_bar=False,
                log_output=log_output, execution_timeout=timeout, start_timeout=180, report_mode=False)
    except pm.PapermillExecutionError as exc:
        error = f"{exc.ename}: {exc.evalue}".strip()
        failed_cell = exc.exec_count
    except Exception as exc:  # kernel died, timeout, unreadable notebook: a failed lab, not a crashed runner
        error = f"{type(exc).__name__}: {exc}".strip()
    finally:
        seconds = time.perf_counter() - t0
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    results, found, last = {}, False, ""
    if out_nb.exists():
        executed = nbformat.read(out_nb, as_version=4)
        results, found = extract_results(executed)
        executed.cells = [c for c in executed.cells if RUNNER_TAG not in c.metadata.get("tags", [])]
        last = "" if found else last_output_text(executed)
        nbformat.write(executed, out_nb)
    res = LabResult(lab=path.stem, title=title, status="failed" if error else "passed", seconds=seconds,
                    notebook=out_nb.name, results=results,
                    results_source="RESULTS" if found else ("last output" if last else "none"),
                    last_output=last, error=error, failed_cell=failed_cell)
    if html_notebook and out_nb.exists():
        res.html = render_notebook_html(out_nb)
    return res


def render_notebook_html(nb_path: Path) -> str | None:
    try:
        from nbconvert import HTMLExporter
    except ImportError:
        return None
    body, _ = HTMLExporter().from_filename(str(nb_path))
    target = nb_path.with_suffix(".html")
    target.write_text(body, encoding="utf-8")
    return target.name


# ----------------------------------------------------------------------------------------------- output
def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)) and len(v) > 8:
        return f"[{', '.join(_fmt(x) for x in v[:8])}, … ({len(v)} items)]"
    return str(v)


def summary_table(results: list[LabResult]) -> str:
    w = max([len("lab")] + [len(r.lab) for r in results])
    lines = [f"{'lab':<{w}}  {'status':<6}  {'seconds':>8}  figures / error", "-" * (w + 40)]
    for r in results:
        extra = r.error[:70] if r.error else (f"{len(r.results)} figure(s)" if r.results else r.results_source)
        lines.append(f"{r.lab:<{w}}  {r.status:<6}  {r.seconds:8.1f}  {extra}")
    passed = sum(r.ok for r in results)
    lines.append("-" * (w + 40))
    lines.append(f"{passed}/{len(results)} passed in {sum(r.seconds for r in results):.1f} s")
    return "\n".join(lines)


_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table.labs{border-collapse:collapse;width:100%} .labs th,.labs td{border:1px solid #ccc;padding:.4em .6em;
vertical-align:top;text-align:left} .labs th{background:#f3f3f3}
.passed{color:#17702c;font-weight:bold} .failed{color:#b00020;font-weight:bold}
table.figs td{border:none;padding:0 .8em 0 0} pre{white-space:pre-wrap;margin:0;font-size:.85em}
.meta{color:#555}
"""


def html_report(results: list[LabResult], meta: dict[str, Any]) -> str:
    e = html.escape
    rows = []
    for r in results:
        if r.results:
            figs = "<table class='figs'>" + "".join(
                f"<tr><td>{e(str(k))}</td><td><b>{e(_fmt(v))}</b></td></tr>" for k, v in r.results.items()
            ) + "</table>"
        elif r.last_output:
            figs = f"<div class='meta'>last output:</div><pre>{e(r.last_output)}</pre>"
        else:
            figs = "<span class='meta'>no figures recorded</span>"
        if r.error:
            where = f" (cell In [{r.failed_cell}])" if r.failed_cell is not None else ""
            figs = f"<pre class='failed'>{e(r.error[:2000])}{e(where)}</pre>" + figs
        links = f"<a href='{e(r.notebook)}'>{e(r.notebook)}</a>"
        if r.html:
            links += f" · <a href='{e(r.html)}'>html</a>"
        rows.append(
            f"<tr id='{e(r.lab)}'><td><b>{e(r.lab)}</b><br><span class='meta'>{e(r.title)}</span></td>"
            f"<td class='{e(r.status)}'>{e(r.status)}</td><td>{r.seconds:.1f}</td><td>{figs}</td>"
            f"<td>{links}</td></tr>")
    passed = sum(r.ok for r in results)
    meta_line = " · ".join(f"{e(str(k))}: {e(str(v))}" for k, v in meta.items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>LLM Serving Lab: run-labs report</title>
<style>{_CSS}</style></head><body>
<h1>LLM Serving Lab: run-labs report</h1>
<p class="meta">{meta_line}</p>
<p><b>{passed}/{len(results)} labs passed</b> in {sum(r.seconds for r in results):.1f} s.</p>
<table class="labs"><thead><tr><th>lab</th><th>status</th><th>seconds</th><th>key measured figures</th>
<th>executed notebook</th></tr></thead><tbody>
{chr(10).join(rows)}
</tbody></table></body></html>
"""


def write_reports(results: list[LabResult], out_dir: Path, meta: dict[str, Any]) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    report = out_dir / "report.html"
    report.write_text(html_report(results, meta), encoding="utf-8")
    summary = out_dir / "summary.json"
    payload = {"meta": meta, "labs": [dict(asdict(r), ok=r.ok) for r in results]}
    summary.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    return report, summary


# ---------------------------------------------------------------------------------------------- syllabus
SYLLABUS = LABS_DIR / "README.md"
_NB_RE = re.compile(r"\b(\d{2}_[A-Za-z0-9_]+)\.ipynb\b")


def format_minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.1f} min"


def _split_row(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _join_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table_span(lines: list[str], heading: str) -> tuple[int, int, int]:
    """(index of the header row, first data row, end) of the first table under `## heading`."""
    start = next((i for i, ln in enumerate(lines) if ln.strip() == f"## {heading}"), None)
    if start is None:
        raise ValueError(f"the syllabus has no '## {heading}' section")
    header = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("|")), None)
    if header is None or any(lines[i].startswith("## ") for i in range(start + 1, header)):
        raise ValueError(f"no table under '## {heading}'")
    end = header + 2
    while end < len(lines) and lines[end].lstrip().startswith("|"):
        end += 1
    return header, header + 2, end


def update_syllabus(text: str, times: dict[str, float], smoke: bool = False) -> tuple[str, list[str]]:
    """Write measured run times (lab stem -> seconds) into the syllabus's `## Labs` table, moving a lab's row there
    from `## Coming` if needed. Full-run (SMOKE off) times are the goal; a SMOKE time is marked "(SMOKE)" and never
    replaces a full-run time. Returns (new text, stems updated)."""
    lines = text.split("\n")
    header, first, end = _table_span(lines, "Labs")
    columns = [c.lower() for c in _split_row(lines[header])]
    col = next((i for i, c in enumerate(columns) if "run time" in c), None)
    if col is None:
        raise ValueError(f"the '## Labs' table has no 'Run time' column: {columns}")
    ready = {(_NB_RE.search(ln) or [None, None])[1]: _split_row(ln) for ln in lines[first:end]}
    c_header, c_first, c_end = _table_span(lines, "Coming")
    coming = {(_NB_RE.search(ln) or [None, None])[1]: i for i, ln in enumerate(lines) if c_first <= i < c_end}
    updated, moved = [], []
    for stem, seconds in times.items():
        if stem in ready:
            row = ready[stem]
        elif stem in coming:
            row = _split_row(lines[coming[stem]])
            row = [re.sub(rf"`?{re.escape(stem)}\.ipynb`?", f"[{stem}]({stem}.ipynb)", c) for c in row]
            moved.append(coming[stem])
        else:
            continue
        if smoke and row[col].strip() and "SMOKE" not in row[col] and row[col].strip() not in ("—", "-"):
            continue  # keep the full-run time
        row[col] = format_minutes(seconds) + (" (SMOKE)" if smoke else "")
        ready[stem] = row
        updated.append(stem)
    if not updated:
        return text, []
    table_rows = [_join_row(ready[k]) for k in sorted(k for k in ready if k)]
    new_lines = lines[:first] + table_rows + [ln for i, ln in enumerate(lines[end:], start=end) if i not in moved]
    return "\n".join(new_lines), updated


# ------------------------------------------------------------------------------------------------- CLI
def run_labs(labs: list[Path], out_dir: Path, *, smoke: bool, device: str, timeout: float | None,
             kernel: str = "python3", html_notebooks: bool = False, verbose: bool = False) -> list[LabResult]:
    import logging

    from tqdm.auto import tqdm

    if not verbose:  # papermill's warnings here are noise (autosave back-off on a busy disk); every name passed is
        # declared in the labs' parameters cells (tests/unit/test_lab_parameters.py)
        logging.getLogger("papermill").setLevel(logging.ERROR)
    results: list[LabResult] = []
    bar = tqdm(labs, unit="lab", desc="run-labs", file=sys.stderr, dynamic_ncols=True)
    for path in bar:
        bar.set_postfix_str(path.stem)
        r = run_lab(path, out_dir, smoke=smoke, device=device, timeout=timeout, kernel=kernel,
                    html_notebook=html_notebooks, log_output=verbose)
        results.append(r)
        bar.write(f"{'ok  ' if r.ok else 'FAIL'} {r.lab} ({r.seconds:.1f} s){'  ' + r.error[:100] if r.error else ''}")
    bar.close()
    return results


def _check_device(device: str) -> str | None:
    if device != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return "--device cuda, but torch sees no CUDA device here (use --device cpu or auto)"
    return None


def _run(args: argparse.Namespace) -> int:
    labs = discover_labs(args.labs_dir, args.only)
    if not labs:
        what = f" matching --only {' '.join(args.only)}" if args.only else ""
        print(f"no labs{what} in {args.labs_dir}", file=sys.stderr)
        return 2
    if args.update_syllabus and args.device == "cuda":
        print("--update-syllabus records CPU times: use --device cpu", file=sys.stderr)
        return 2
    problem = _check_device(args.device)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    out_dir = Path(args.out).resolve()
    print(f"running {len(labs)} lab(s) (SMOKE={args.smoke}, DEVICE={args.device!r}) -> {out_dir}")
    results = run_labs(labs, out_dir, smoke=args.smoke, device=args.device, timeout=args.timeout,
                       kernel=args.kernel, html_notebooks=args.html_notebooks, verbose=args.verbose)
    meta = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
            "python": platform.python_version(), "smoke": args.smoke, "device": args.device}
    report, summary = write_reports(results, out_dir, meta)
    print()
    print(summary_table(results))
    print(f"report: {report}\nsummary: {summary}")
    if args.update_syllabus:
        times = {r.lab: r.seconds for r in results if r.ok}
        syllabus = Path(args.labs_dir) / "README.md"
        try:
            text, updated = update_syllabus(syllabus.read_text(encoding="utf-8"), times, smoke=args.smoke)
        except (OSError, ValueError) as exc:
            print(f"syllabus not updated: {exc}", file=sys.stderr)
            return 1
        if updated:
            syllabus.write_text(text, encoding="utf-8")
        print(f"syllabus: run time of {', '.join(updated) or 'no lab'} written to {syllabus}")
    return 0 if all(r.ok for r in results) else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("run-labs", help="execute the labs with papermill; table + HTML report",
                              description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="SMOKE=True: tiny sizes (CI; < ~2 min a lab on 2 CPU cores)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--only", action="append", metavar="NN",
                   help="run only these labs, by number or name (repeat, or comma-separate: --only 00,05)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: out/labs)")
    p.add_argument("--labs-dir", type=Path, default=LABS_DIR, help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per cell before a lab fails (default 1800)")
    p.add_argument("--kernel", default="python3", help="Jupyter kernel name (default python3)")
    p.add_argument("--html-notebooks", action="store_true", help="also render each executed notebook to HTML")
    p.add_argument("--verbose", action="store_true", help="stream the notebooks' own output")
    p.add_argument("--update-syllabus", action="store_true",
                   help="write each passed lab's run time into labs/README.md (CPU only; SMOKE times are marked)")
    p.set_defaults(func=_run)
