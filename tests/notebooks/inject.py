"""Run a lab with other code in place of one exercise's solution: how tests prove that a wrong learner
implementation makes the lab fail with its check's message (not deep inside the engine).

    run_with_solution(LABS / "03_chunked_prefill.ipynb", "def schedule_token_budget(", WRONG_BODY, tmp_path)

copies the lab, replaces the first `### BEGIN SOLUTION` ... `### END SOLUTION` region that follows the marker
text (in the cell that holds it) with `new_body`, and executes the copy with papermill in SMOKE mode, from
`tmp_path`, with the learner's saved parts in `tmp_path/my_engine`. A failing cell raises
`papermill.PapermillExecutionError`; the executed notebook is `tmp_path/executed.ipynb`.
"""
from __future__ import annotations

import os
import textwrap
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


def replace_solution(source: str, marker: str, new_body: str) -> str:
    """`source` with the first solution region after `marker` replaced by `new_body` (indented to the region)."""
    at = source.index(marker)
    start = source.index(BEGIN, at)
    end = source.index(END, start) + len(END)
    line_start = source.rfind("\n", 0, start) + 1
    indent = source[line_start:start]
    body = textwrap.indent(textwrap.dedent(new_body).strip("\n"), indent)
    return source[:line_start] + body + source[end:]


def run_with_solution(lab_path: Path, part_marker_text: str, new_body: str, tmp_path: Path,
                      timeout: int = 600) -> nbformat.NotebookNode:
    """Execute a copy of `lab_path` whose exercise at `part_marker_text` runs `new_body`; returns the executed
    notebook (papermill.PapermillExecutionError when a cell fails)."""
    import papermill as pm

    nb = nbformat.read(lab_path, as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code" and part_marker_text in c.source and BEGIN in c.source]
    if len(cells) != 1:
        raise ValueError(f"{lab_path.name}: {len(cells)} exercise cells contain {part_marker_text!r}; need exactly 1")
    cells[0].source = replace_solution(cells[0].source, part_marker_text, new_body)
    tmp_path = Path(tmp_path)
    src, out = tmp_path / lab_path.name, tmp_path / "executed.ipynb"
    nbformat.write(nb, src)
    env = {"LAB_SMOKE": "1", "LAB_INTERACTIVE": "0", "LAB_LEARNER_DIR": str(tmp_path / "my_engine"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        pm.execute_notebook(str(src), str(out), cwd=str(tmp_path), kernel_name="python3", progress_bar=False,
                            execution_timeout=timeout)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nbformat.read(out, as_version=4)


def failed_cell(tmp_path: Path) -> nbformat.NotebookNode:
    """The cell of `tmp_path/executed.ipynb` that raised (the first with an error output)."""
    nb = nbformat.read(Path(tmp_path) / "executed.ipynb", as_version=4)
    return next(c for c in nb.cells if c.cell_type == "code"
                and any(o.get("output_type") == "error" for o in c.get("outputs", [])))


def assert_fails_at_check(lab_path: Path, marker: str, body: str, message: str, check: str, tmp_path: Path) -> None:
    """The lab with `body` in the exercise at `marker` stops with an AssertionError carrying `message`, raised in
    the cell that calls `check` (not deeper in the lab), and the failed part is not saved as the learner's."""
    import papermill
    import pytest

    with pytest.raises(papermill.PapermillExecutionError) as err:
        run_with_solution(lab_path, marker, body, tmp_path)
    assert err.value.ename == "AssertionError", f"{err.value.ename}: {err.value.evalue}"
    assert message in str(err.value), str(err.value)[-2000:]
    cell = failed_cell(tmp_path)
    assert check in cell.source, f"the lab failed in another cell than its check:\n{cell.source}"
