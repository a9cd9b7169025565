"""The learner-copy transform (`make student`): pure functions on synthetic notebooks, no kernel needed."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from lab_utils.course import learner_copies
from lab_utils.course.learner_copies import (
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
    readme = (out / "README.md").read_text()
    assert readme.startswith("# Your copies of the labs") and "solved notebooks are in" in readme
    assert readme.endswith("# syllabus\n")
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
    assert learner_copies.BEGIN == "### BEGIN SOLUTION" and learner_copies.END == "### END SOLUTION"


# ------------------------------------------------------------------ make lab: never overwrite a learner's work
def test_keep_existing_writes_missing_copies_and_keeps_the_learners(tmp_path, capsys):
    labs, out = tmp_path / "labs", tmp_path / "student"
    labs.mkdir()
    nbformat.write(synthetic_lab(), labs / "98_first.ipynb")
    nbformat.write(synthetic_lab(), labs / "99_second.ipynb")
    write_student_copies(labs, out, quiet=True)
    mine = out / "98_first.ipynb"
    mine.write_text(mine.read_text().replace("print(N)", "print(N)  # my work"))
    (out / "99_second.ipynb").unlink()
    write_student_copies(labs, out, keep_existing=True)
    assert "# my work" in mine.read_text(), "make lab must never overwrite a learner's copy"
    assert (out / "99_second.ipynb").exists(), "a missing copy is written"
    said = capsys.readouterr().out
    assert "98_first.ipynb: kept your copy" in said and "delete it" in said
    write_student_copies(labs, out)  # `make student`: a fresh copy from labs/
    assert "# my work" not in mine.read_text()


# ------------------------------------------------------------------------- how much code the learner writes
def test_exercise_sizes_count_code_lines_inside_regions_only():
    # EXERCISE: 2 code lines (the hint, the later comment and the docstring outside the region do not count);
    # the class cell: one line in each of its two regions; the top-level cell: `N = 30`
    assert learner_copies.exercise_sizes(synthetic_lab()) == [2, 2, 1]
    assert learner_copies.code_lines(["", "   ", "# c", "  # c", "x = 1", "  return x  # note"]) == 2


def _stats_labs(tmp_path, sizes: dict[str, int]) -> Path:
    """A labs folder whose lab NN has one exercise of `sizes[NN]` code lines (plus a comment and a blank)."""
    labs = tmp_path / "labs"
    labs.mkdir()
    for lab, n in sizes.items():
        nb = V4.new_notebook()
        body = "\n".join(f"    x{k} = {k}" for k in range(n))
        nb.cells = [V4.new_code_cell(f"def f():\n    ### BEGIN SOLUTION\n    # Hint: h\n\n{body}\n"
                                     f"    ### END SOLUTION\n")]
        nbformat.write(nb, labs / f"{lab}_lab.ipynb")
    return labs


def test_stats_table_rows_and_totals(tmp_path):
    labs = _stats_labs(tmp_path, {"00": 3, "04": 50, "05": 7})
    stats = learner_copies.lab_stats(labs)
    assert [(s.lab, s.sizes, s.lines, s.largest) for s in stats] == [
        ("00", (3,), 3, 3), ("04", (50,), 50, 50), ("05", (7,), 7, 7)]
    table = learner_copies.stats_table(stats).splitlines()
    assert table[0].split() == ["lab", "notebook", "exercises", "lines", "largest"]
    assert table[1].split() == ["00", "00_lab", "1", "3", "3"]
    assert table[-2].split() == ["labs", "00-04", "2", "53", "50"]
    assert table[-1].split() == ["all", "labs", "(total)", "3", "60", "50"]


def test_stats_thresholds(tmp_path):
    stats = learner_copies.lab_stats(_stats_labs(tmp_path, {"00": 3, "04": 50, "05": 7}))
    assert learner_copies.threshold_problems(stats) == []
    assert learner_copies.threshold_problems(stats, min_total=53, max_exercise=50) == []
    problems = learner_copies.threshold_problems(stats, min_total=120, max_exercise=40)
    assert len(problems) == 2
    assert "53 learner-written lines" in problems[0] and "at least 120" in problems[0]
    assert problems[1].startswith("04_lab: exercise 1 has 50 lines")


def test_stats_cli_prints_the_table_and_exits_on_thresholds(tmp_path):
    labs = _stats_labs(tmp_path, {"01": 4, "02": 41})

    def cli(*extra):
        return subprocess.run([sys.executable, "-m", "lab_utils", "student", "--stats", "--labs-dir", str(labs),
                               *extra], check=False, capture_output=True, text=True, timeout=120)

    ok = cli()
    assert ok.returncode == 0, ok.stderr
    assert "02_lab" in ok.stdout and "labs 00-04" in ok.stdout and "below target" not in ok.stdout
    assert not (tmp_path / "student").exists()
    bad = cli("--min-total", "120", "--max-exercise", "40")
    assert bad.returncode == 1 and "below target: labs 00-04 have 45" in bad.stdout
    assert "02_lab: exercise 1 has 41 lines" in bad.stdout


def test_stats_of_the_real_labs_cover_every_lab():
    stats = learner_copies.lab_stats(learner_copies.REPO_ROOT / "labs")
    assert [s.name for s in stats] == [p.stem for p in LABS]
    assert all(s.sizes and s.lines > 0 for s in stats), "every lab has an exercise with code in it"


# ---------------------------------------------------------------- the learner copies hold no solution text
LABS = sorted((learner_copies.REPO_ROOT / "labs").glob("*.ipynb"))
_TRIVIAL_RE = re.compile(r"^(?:[\s()\[\]{}:,]*|(?:else|try|finally|pass|break|continue|return)\s*:?)$")


def solution_leaks(lab: nbformat.NotebookNode, copy: nbformat.NotebookNode) -> list[str]:
    """Code lines of a solution region that are still in the learner copy's cell (lines with no content of
    their own, like `else:`, `break` or a closing bracket, aside), and outputs left in the copy."""
    leaks = []
    for i in exercise_cells(lab):
        src = lab.cells[i].source.split("\n")
        learner = {line.strip() for line in copy.cells[i].source.split("\n")}
        for r in learner_copies.find_regions(lab.cells[i].source):
            for line in src[r.start + 1:r.end]:
                text = line.strip()
                if text and not text.startswith("#") and not _TRIVIAL_RE.match(text) and text in learner:
                    leaks.append(f"cell {i}: {text}")
    leaks += [f"cell {i}: an output" for i, c in enumerate(copy.cells) if c.cell_type == "code" and c.outputs]
    return leaks


def test_solution_leaks_catches_a_line_given_away():
    lab = synthetic_lab()
    lab.cells[3].source = "half = x.shape[-1] // 2\n" + lab.cells[3].source  # the author gave a line away
    copy = make_student_notebook(lab, "lab99")
    assert solution_leaks(lab, copy) == ["cell 3: half = x.shape[-1] // 2"]
    assert solution_leaks(synthetic_lab(), make_student_notebook(synthetic_lab(), "lab99")) == []


@pytest.fixture(scope="module")
def copies_dir(tmp_path_factory) -> Path:
    """The learner copies as `make lab` and Binder write them."""
    out = tmp_path_factory.mktemp("student")
    write_student_copies(learner_copies.REPO_ROOT / "labs", out, quiet=True)
    return out


@pytest.mark.parametrize("lab", LABS, ids=[p.stem for p in LABS])
def test_learner_copy_holds_no_solution_text(lab, copies_dir):
    source = nbformat.read(lab, as_version=4)
    copy = nbformat.read(copies_dir / lab.name, as_version=4)
    assert len(copy.cells) == len(source.cells)
    assert exercise_cells(source), f"{lab.name} has no exercise"
    text = "\n".join(c.source for c in copy.cells)
    assert learner_copies.BEGIN not in text and learner_copies.END not in text
    leaks = solution_leaks(source, copy)
    assert not leaks, (f"the learner copy of {lab.name} gives solution lines away (move them inside the solution "
                       f"region, or out of the exercise cell):\n" + "\n".join(leaks))


# -------------------------------------------------- make lab, Binder and the README open the learner copies
def test_make_lab_binder_and_readme_point_at_the_learner_copies():
    root = learner_copies.REPO_ROOT
    makefile = (root / "Makefile").read_text(encoding="utf-8")
    recipe = makefile.split("\nlab:", 1)[1].split("\n\n", 1)[0]
    assert "-m lab_utils student --out student --keep-existing" in recipe, "make lab writes the missing copies"
    assert "--ServerApp.root_dir=student" in recipe and "$(LAB_ARGS)" in recipe
    assert "-m lab_utils student --stats" in makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    post = (root / "binder" / "postBuild").read_text(encoding="utf-8")
    assert "python -m lab_utils student --out student" in post
    readme = (root / "README.md").read_text(encoding="utf-8")
    badge = re.search(r"\(https://mybinder\.org/v2/gh/[^)]*\)", readme).group(0)
    assert "urlpath=lab/tree/student/00_foundations.ipynb" in badge
    two = readme.split("## Two commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert [line.split()[0:2] for line in two.strip().splitlines()] == [["make", "lab"], ["make", "test"]]
    ignored = subprocess.run(["git", "check-ignore", "student/00_foundations.ipynb", "labs/my_engine/scheduler.py",
                              "student/my_engine/scheduler.py"], check=False, cwd=root, capture_output=True,
                             text=True)
    if ignored.returncode != 128:  # 128: not a git checkout (an unpacked release): nothing to ignore
        assert len(ignored.stdout.split()) == 3, f".gitignore must cover student/ and my_engine/: {ignored.stdout}"


# ------------------------------------------------------------- a wrong part injected into a lab (for its tests)
def test_inject_solution_replaces_one_region_and_keeps_the_rest():
    nb = synthetic_lab()
    i = learner_copies.inject_solution(nb, "def rope", "half = 0\nreturn x  # wrong on purpose\n")
    assert i == 3
    src = nb.cells[3].source
    assert "    half = 0\n    return x  # wrong on purpose\n    ### END SOLUTION" in src
    assert "torch.cat" not in src and src.startswith("import torch") and src.endswith('print("defined")')
    ns: dict = {}
    exec(compile(src, "<lab>", "exec"), ns)
    assert ns["rope"](5, None, None) == 5
    two = learner_copies.replace_solution(nb.cells[5].source, "return 20", region=1)
    assert "return 1\n" in two and "        return 20\n" in two and "return 2\n" not in two
    with pytest.raises(IndexError, match="no region 2"):
        learner_copies.replace_solution(nb.cells[5].source, "x", region=2)
    with pytest.raises(ValueError, match="0 exercise cells contain"):
        learner_copies.inject_solution(nb, "def nowhere", "pass")
