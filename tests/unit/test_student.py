"""The learner-copy transform (`make student`): pure functions on synthetic notebooks, no kernel needed."""
from __future__ import annotations

import ast
import subprocess
import sys

import nbformat
import pytest

from lab_utils import student
from lab_utils.student import (
    DEFAULT_HINT,
    EXERCISE_TAG,
    SolutionMarkerError,
    exercise_cells,
    first_exercise_index,
    make_student_notebook,
    strip_source,
    write_student_copies,
)

V4 = nbformat.v4

EXERCISE = '''\
import torch

def rope(x, cos, sin):
    """Rotate pairs of dimensions."""
    ### BEGIN SOLUTION
    # Hint: rotate pairs (i, i + D/2) with "cos" and sin
    # then add the two parts
    half = x.shape[-1] // 2
    # this later comment is not the hint
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin
    ### END SOLUTION

print("defined")'''


def synthetic_lab() -> nbformat.NotebookNode:
    nb = V4.new_notebook()
    params = V4.new_code_cell('import os\nSMOKE = os.environ.get("LAB_SMOKE", "0") == "1"')
    params.metadata["tags"] = ["parameters"]
    ran = V4.new_code_cell("x = 1\nx", execution_count=3,
                           outputs=[V4.new_output("execute_result", {"text/plain": "1"}, execution_count=3)])
    ran.metadata["execution"] = {"iopub.status.busy": "2024-01-01"}
    two = V4.new_code_cell(
        "class Step:\n    def a(self):\n        ### BEGIN SOLUTION\n        # Hint: first\n        return 1\n"
        "        ### END SOLUTION\n\n    def b(self):\n        ### BEGIN SOLUTION\n        return 2\n"
        "        ### END SOLUTION\n")
    top = V4.new_code_cell("### BEGIN SOLUTION\n# Hint: set N to the number of layers\nN = 30\n### END SOLUTION\n"
                           "print(N)")
    nb.cells = [V4.new_markdown_cell("# Lab 99\n### BEGIN SOLUTION in markdown is left alone"), params, ran,
                V4.new_code_cell(EXERCISE), V4.new_markdown_cell("check"), two, top]
    nb.metadata["papermill"] = {"parameters": {}}
    return nb


def test_region_becomes_raise_with_the_first_comment_as_hint():
    out, hints = strip_source(EXERCISE)
    assert hints == ['Hint: rotate pairs (i, i + D/2) with "cos" and sin then add the two parts']
    assert "BEGIN SOLUTION" not in out and "END SOLUTION" not in out
    assert "torch.cat" not in out and "half" not in out and "later comment" not in out  # solution gone
    lines = out.split("\n")
    raise_line = next(line for line in lines if "NotImplementedError" in line)
    assert raise_line == ('    raise NotImplementedError("Hint: rotate pairs (i, i + D/2) with \\"cos\\" and sin '
                          'then add the two parts")')
    assert lines[-1] == 'print("defined")' and '"""Rotate pairs of dimensions."""' in out
    tree = ast.parse(out)  # still valid Python, and the hint survives as the exception message
    msg = next(n for n in ast.walk(tree) if isinstance(n, ast.Raise)).exc.args[0].value
    assert msg == hints[0]


def test_executing_the_stripped_code_raises_with_the_hint():
    out, _ = strip_source("def f():\n    ### BEGIN SOLUTION\n    # Hint: return 42\n    return 42\n"
                          "    ### END SOLUTION\n")
    ns: dict = {}
    exec(compile(out, "<student>", "exec"), ns)
    with pytest.raises(NotImplementedError, match="Hint: return 42"):
        ns["f"]()


def test_several_regions_tabs_top_level_and_default_hint():
    nb = synthetic_lab()
    stu = make_student_notebook(nb, "lab99")
    two, top = stu.cells[5].source, stu.cells[6].source
    assert two.count("NotImplementedError") == 2
    assert '        raise NotImplementedError("Hint: first")' in two
    assert f'        raise NotImplementedError("{DEFAULT_HINT}")' in two
    assert top.startswith('raise NotImplementedError("Hint: set N to the number of layers")\nprint(N)')
    tabbed, _ = strip_source("class T:\n\tdef b(self):\n\t\t### BEGIN SOLUTION\n\t\treturn 2\n\t\t### END SOLUTION\n")
    assert f'\t\traise NotImplementedError("{DEFAULT_HINT}")' in tabbed
    for src in (two, top, tabbed):
        ast.parse(src)


def test_notebook_outputs_cleared_tags_and_source_untouched():
    nb = synthetic_lab()
    before = nbformat.writes(nb)
    stu = make_student_notebook(nb, "lab99")
    assert nbformat.writes(nb) == before, "the source notebook must not be modified"
    nbformat.validate(stu)
    codes = [c for c in stu.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in codes)
    assert "execution" not in stu.cells[2].metadata and "papermill" not in stu.metadata
    assert stu.cells[0].source == nb.cells[0].source  # markdown untouched
    assert stu.cells[1].metadata["tags"] == ["parameters"]
    assert exercise_cells(nb) == [3, 5, 6]
    assert [i for i, c in enumerate(stu.cells) if EXERCISE_TAG in c.metadata.get("tags", [])] == [3, 5, 6]
    assert first_exercise_index(stu) == 3


def test_transform_is_idempotent():
    stu = make_student_notebook(synthetic_lab(), "lab99")
    again = make_student_notebook(stu, "lab99")
    assert nbformat.writes(again) == nbformat.writes(stu)


@pytest.mark.parametrize("src, msg", [
    ("### BEGIN SOLUTION\nx = 1\n", "never closed"),
    ("x = 1\n### END SOLUTION\n", "without a"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "inside the region"),
    ("### BEGIN SOLUTION  # typo\nx=1\n### END SOLUTION\n", "looks like a solution marker"),
])
def test_unbalanced_markers_are_reported_with_line(src, msg):
    with pytest.raises(SolutionMarkerError, match=msg) as err:
        strip_source(src, where="lab99, cell 4")
    assert "lab99, cell 4, line" in str(err.value)


def test_write_student_copies_is_idempotent_and_refuses_to_overwrite_labs(tmp_path):
    labs = tmp_path / "labs"
    labs.mkdir()
    nbformat.write(synthetic_lab(), labs / "99_synthetic.ipynb")
    (labs / "README.md").write_text("# syllabus\n")
    out = tmp_path / "student"
    first = write_student_copies(labs, out, quiet=True)
    assert [p.name for p in first] == ["99_synthetic.ipynb"]
    snapshot = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(snapshot) == {"99_synthetic.ipynb", "README.md"}
    write_student_copies(labs, out, quiet=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == snapshot
    copy = nbformat.read(out / "99_synthetic.ipynb", as_version=4)
    assert "BEGIN SOLUTION" not in "".join(c.source for c in copy.cells if c.cell_type == "code")
    with pytest.raises(ValueError, match="overwrite the solutions"):
        write_student_copies(labs, labs)


def test_cli_writes_copies(tmp_path):
    labs = tmp_path / "labs"
    labs.mkdir()
    nbformat.write(synthetic_lab(), labs / "99_synthetic.ipynb")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "lab_utils", "student", "--out", str(out), "--labs-dir", str(labs)],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "99_synthetic.ipynb: 3 exercise cell(s)" in proc.stdout
    assert (out / "99_synthetic.ipynb").exists()


def test_module_documents_the_markers():
    assert student.BEGIN == "### BEGIN SOLUTION" and student.END == "### END SOLUTION"
