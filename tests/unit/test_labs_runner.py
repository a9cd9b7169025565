"""run-labs without kernels: lab selection, reading figures from executed notebooks, the report, the syllabus."""
from __future__ import annotations

import subprocess
import sys

import nbformat
import pytest

from lab_utils.labs_runner import (
    RESULTS_MARK,
    RUNNER_TAG,
    LabResult,
    discover_labs,
    extract_results,
    format_minutes,
    html_report,
    last_output_text,
    summary_table,
    update_syllabus,
)
from lab_utils.paths import REPO_ROOT

V4 = nbformat.v4


def test_discover_labs_by_number_or_name(tmp_path):
    for name in ["00_a", "03_chunked", "10_big", "12_end"]:
        nbformat.write(V4.new_notebook(), tmp_path / f"{name}.ipynb")
    (tmp_path / ".hidden.ipynb").write_text("{}")
    names = lambda only: [p.stem for p in discover_labs(tmp_path, only)]  # noqa: E731
    assert names(None) == ["00_a", "03_chunked", "10_big", "12_end"]
    assert names(["3"]) == names(["03"]) == names(["03_chunked"]) == ["03_chunked"]
    assert names(["00,12", "10"]) == ["00_a", "10_big", "12_end"]
    assert names(["1"]) == []  # "1" is lab 01, not every lab starting with 1
    assert names(["99"]) == []


def _executed(results_line: str | None, outputs: list) -> nbformat.NotebookNode:
    nb = V4.new_notebook()
    last = V4.new_code_cell("x", outputs=outputs)
    plot = V4.new_code_cell("fig.show()",
                            outputs=[V4.new_output("display_data", {"application/vnd.plotly.v1+json": {}})])
    cells = [last, plot]
    if results_line is not None:
        runner = V4.new_code_cell("...", outputs=[V4.new_output("stream", name="stdout", text=results_line)])
        runner.metadata["tags"] = [RUNNER_TAG]
        cells.append(runner)
    nb.cells = cells
    return nb


def test_results_come_from_the_runner_cell_else_the_last_text_output():
    nb = _executed(RESULTS_MARK + '{"speedup": 5.4, "ok": true}\n', [])
    assert extract_results(nb) == ({"speedup": 5.4, "ok": True}, True)
    nb = _executed(None, [V4.new_output("stream", name="stdout", text="PASS claim\n")])
    assert extract_results(nb) == ({}, False)
    assert last_output_text(nb) == "PASS claim"  # the plot after it has no text and is skipped
    nb = _executed(None, [V4.new_output("execute_result", {"text/plain": "x" * 3000}, execution_count=1)])
    assert len(last_output_text(nb, limit=100)) == 102


def _result(lab, status="passed", **kw):
    return LabResult(lab=lab, title=f"Title {lab}", status=status, seconds=12.34, notebook=f"{lab}.ipynb", **kw)


def test_report_lists_every_lab_escaped_with_links_and_figures():
    results = [_result("00_a", results={"speedup": 5.4321, "device": "cpu"}, results_source="RESULTS"),
               _result("01_b", last_output="<script>alert(1)</script>", results_source="last output"),
               _result("02_c", status="failed", error="AssertionError: x < y", failed_cell=7)]
    page = html_report(results, {"smoke": True})
    for r in results:
        assert f"<tr id='{r.lab}'>" in page and f"href='{r.lab}.ipynb'" in page
    assert "5.432" in page and "&lt;script&gt;" in page and "<script>" not in page
    assert "AssertionError: x &lt; y (cell In [7])" in page and "2/3 labs passed" in page
    table = summary_table(results)
    assert "02_c" in table and "failed" in table and "2/3 passed" in table


SYLLABUS = """# Syllabus

## Labs

| Lab | Notebook | Goal | Run time (CPU, measured) |
|-----|----------|------|--------------------------|
| 01 | [01_b](01_b.ipynb) | batching | 2.0 min |

## Coming

| Lab | Notebook | Goal | Run time (CPU, measured) |
|-----|----------|------|--------------------------|
| 00 | `00_a.ipynb` | basics | — |
| 02 | `02_c.ipynb` | paging | — |

## Learning goals per lab
"""


def test_update_syllabus_moves_landed_labs_and_writes_times():
    text, updated = update_syllabus(SYLLABUS, {"00_a": 187.3, "01_b": 45.0, "99_unknown": 1.0})
    assert updated == ["00_a", "01_b"]
    labs = text.split("## Labs")[1].split("## Coming")[0]
    coming = text.split("## Coming")[1].split("## Learning")[0]
    assert "| 00 | [00_a](00_a.ipynb) | basics | 3.1 min |" in labs
    assert "| 01 | [01_b](01_b.ipynb) | batching | 45 s |" in labs
    assert labs.index("00_a") < labs.index("01_b")  # kept in lab order
    assert "00_a" not in coming and "02_c.ipynb" in coming
    assert update_syllabus(text, {"00_a": 187.3, "01_b": 45.0})[0] == text  # idempotent
    assert update_syllabus(SYLLABUS, {}) == (SYLLABUS, [])
    with pytest.raises(ValueError, match="no '## Coming'"):
        update_syllabus(SYLLABUS.replace("## Coming", "## Later"), {"00_a": 1})
    assert format_minutes(59) == "59 s" and format_minutes(90) == "1.5 min"


def test_the_real_syllabus_parses():
    text = (REPO_ROOT / "labs" / "README.md").read_text(encoding="utf-8")
    assert update_syllabus(text, {}) == (text, [])  # both tables found, nothing to change


def test_update_syllabus_marks_smoke_times_and_keeps_full_run_times():
    text, updated = update_syllabus(SYLLABUS, {"00_a": 30.0}, smoke=True)
    assert updated == ["00_a"] and "| 30 s (SMOKE) |" in text
    full, _ = update_syllabus(text, {"00_a": 187.3})  # a full run replaces a SMOKE time
    assert "| 3.1 min |" in full and "(SMOKE)" not in full.split("## Coming")[0]
    again, _ = update_syllabus(full, {"00_a": 20.0}, smoke=True)  # a SMOKE time never replaces a full-run time
    assert "| 3.1 min |" in again


def test_update_syllabus_refuses_cuda_times():
    proc = subprocess.run([sys.executable, "-m", "lab_utils", "run-labs", "--device", "cuda", "--update-syllabus"],
                          check=False, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 2 and "CPU times" in proc.stderr
