"""nbgrader's `generate_assignment` on the labs against `lab_utils student`: where the two learner copies differ.

The labs' solution markers are nbgrader's, so nbgrader can release them, with two differences this test pins:
1. nbgrader refuses the labs as they are (their exercise cells carry no nbgrader metadata) unless told
   `ClearSolutions.enforce_metadata=False` (or the cells are marked as solution cells);
2. each solution region becomes nbgrader's fixed stub, `# YOUR CODE HERE` / `raise NotImplementedError()`, where
   `lab_utils student` writes the line naming the exercise's hints and `raise NotImplementedError("<contract>")`
   (the region's first comment). Every other line of every cell, the outputs (cleared) and the notebook's metadata
   are the same; `lab_utils student` also tags the exercise cells `exercise`.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from lab_utils.course.learner_copies import (
    EXERCISE_TAG,
    lab_notebooks,
    make_student_notebook,
)

pytest.importorskip("nbgrader", reason="skipped: nbgrader not installed (pip install -e .[dev])")
REPO = Path(__file__).resolve().parents[2]
NBGRADER_STUB = "{0}# YOUR CODE HERE\n{0}raise NotImplementedError()"
# one region of a `lab_utils student` copy: the hint line, then the raise carrying the contract
OUR_STUB = re.compile(r'^(?P<indent>[ \t]*)# Stuck\? from lab_utils\.hints import hint; hint\("\d\d\.\w+"\) gives '
                      r'the idea, levels 2 and 3 more\n(?P=indent)raise NotImplementedError\(".+"\)$', re.MULTILINE)


def _generate(course: Path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "nbgrader", "generate_assignment", "labs", "--no-db", "--force",
           f"--CourseDirectory.root={course}", *flags]
    return subprocess.run(cmd, cwd=course, check=False, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    course = tmp_path_factory.mktemp("course")
    (course / "source" / "labs").mkdir(parents=True)
    for nb in lab_notebooks(REPO / "labs"):
        shutil.copy(nb, course / "source" / "labs" / nb.name)
    refused = _generate(course)
    assert refused.returncode != 0 and "Solution region detected in a non-solution cell" in refused.stderr
    done = _generate(course, "--ClearSolutions.enforce_metadata=False")
    assert done.returncode == 0, done.stderr[-3000:]
    return course / "release" / "labs"


@pytest.mark.slow
def test_nbgrader_gives_our_stubs_but_for_the_stub_lines(released):
    labs = lab_notebooks(REPO / "labs")
    assert len(labs) >= 14 and sorted(p.name for p in released.glob("*.ipynb")) == [p.name for p in labs]
    regions = 0
    for path in labs:
        theirs = nbformat.read(released / path.name, as_version=4)
        ours = make_student_notebook(nbformat.read(path, as_version=4), name=path.name)
        assert theirs.metadata == ours.metadata, path.name
        assert [c.cell_type for c in theirs.cells] == [c.cell_type for c in ours.cells], path.name
        for i, (t, o) in enumerate(zip(theirs.cells, ours.cells)):
            where = f"{path.name}, cell {i}"
            regions += len(OUR_STUB.findall(o.source))
            assert OUR_STUB.sub(lambda m: NBGRADER_STUB.format(m["indent"]), o.source) == t.source, where
            if o.cell_type == "code":
                assert t.outputs == o.outputs == [] and t.execution_count is o.execution_count is None, where
            extra = {k: v for k, v in o.metadata.items() if t.metadata.get(k) != v}
            assert extra in ({}, {"tags": [*t.metadata.get("tags", []), EXERCISE_TAG]}), where
    assert regions >= 30  # every exercise of every lab was compared
