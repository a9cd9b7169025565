"""Learner copies of the labs: every solution region becomes `raise NotImplementedError("<hint>")`.

    python -m lab_utils student --out student        (what `make student` runs)

In a lab, the reference solution of an exercise sits between two marker lines; the first comment inside is
the hint the learner sees:

    def rope(x, cos, sin):
        ### BEGIN SOLUTION
        # Hint: rotate pairs (i, i + D/2) ...
        return x * cos + rotate_half(x) * sin
        ### END SOLUTION

becomes, in the learner's copy,

    def rope(x, cos, sin):
        raise NotImplementedError("Hint: rotate pairs (i, i + D/2) ...")

Outputs and execution counts are cleared and cells that held a solution get the tag `exercise`. The transform
is a pure function of the source notebook, so running it twice writes the same bytes (idempotent), and running
it on a learner copy changes nothing.
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import nbformat

from lab_utils.paths import REPO_ROOT

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
EXERCISE_TAG = "exercise"
DEFAULT_HINT = "Your turn: implement this (see the text above the cell)."
_BEGIN_RE = re.compile(r"^(?P<indent>[ \t]*)### BEGIN SOLUTION\s*$")
_END_RE = re.compile(r"^[ \t]*### END SOLUTION\s*$")
_COMMENT_RE = re.compile(r"^[ \t]*#(?!##)\s?(?P<text>.*)$")

# execution / papermill bookkeeping that must not leak into a learner's copy
_CELL_META_DROP = ("execution", "papermill", "collapsed", "scrolled", "ExecuteTime")
_NB_META_DROP = ("papermill", "widgets")


class SolutionMarkerError(ValueError):
    """A BEGIN without its END (or the reverse): the lab's author must fix the markers."""


@dataclass(frozen=True)
class Region:
    start: int  # line index of the BEGIN marker
    end: int  # line index of the END marker
    indent: str
    hint: str


def find_regions(source: str, where: str = "cell") -> list[Region]:
    """Solution regions of one cell's source, in order. Raises `SolutionMarkerError` on unbalanced markers."""
    lines = source.split("\n")
    regions: list[Region] = []
    open_at: int | None = None
    indent = ""
    for i, line in enumerate(lines):
        m = _BEGIN_RE.match(line)
        if m:
            if open_at is not None:
                raise SolutionMarkerError(
                    f"{where}, line {i + 1}: '{BEGIN}' inside the region opened on line {open_at + 1}; "
                    f"close it with '{END}' first")
            open_at, indent = i, m.group("indent")
        elif _END_RE.match(line):
            if open_at is None:
                raise SolutionMarkerError(f"{where}, line {i + 1}: '{END}' without a '{BEGIN}' before it")
            regions.append(Region(open_at, i, indent, _hint(lines[open_at + 1:i])))
            open_at = None
        elif line.strip().startswith("###") and "SOLUTION" in line:
            raise SolutionMarkerError(
                f"{where}, line {i + 1}: {line.strip()!r} looks like a solution marker but is not exactly "
                f"'{BEGIN}' or '{END}' on a line of its own")
    if open_at is not None:
        raise SolutionMarkerError(f"{where}, line {open_at + 1}: '{BEGIN}' is never closed by '{END}'")
    return regions


def _hint(body: list[str]) -> str:
    """The region's first comment: consecutive `#` lines from the first one, joined into one sentence."""
    parts: list[str] = []
    for line in body:
        m = _COMMENT_RE.match(line)
        if m:
            parts.append(m.group("text").strip())
        elif parts:  # the first comment block ended (code or a blank line follows it)
            break
    hint = " ".join(p for p in parts if p)
    return hint or DEFAULT_HINT


def _raise_line(indent: str, hint: str) -> str:
    # json's string escapes (\" \\ \n \uXXXX) are valid Python string escapes
    return f"{indent}raise NotImplementedError({json.dumps(hint, ensure_ascii=False)})"


def strip_source(source: str, where: str = "cell") -> tuple[str, list[str]]:
    """Replace each solution region of a cell's source; returns (new source, hints)."""
    regions = find_regions(source, where)
    if not regions:
        return source, []
    lines = source.split("\n")
    out: list[str] = []
    pos = 0
    for r in regions:
        out.extend(lines[pos:r.start])
        out.append(_raise_line(r.indent, r.hint))
        pos = r.end + 1
    out.extend(lines[pos:])
    return "\n".join(out), [r.hint for r in regions]


def is_exercise_source(source: str) -> bool:
    return any(_BEGIN_RE.match(line) for line in source.split("\n"))


def exercise_cells(nb: nbformat.NotebookNode) -> list[int]:
    """Indices of the code cells that hold a solution region (in the source lab)."""
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and is_exercise_source(c.source)]


def make_student_notebook(nb: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """The learner's copy of `nb` (a new object; `nb` is not modified)."""
    out = copy.deepcopy(nb)
    for key in _NB_META_DROP:
        out.metadata.pop(key, None)
    for i, cell in enumerate(out.cells):
        for key in _CELL_META_DROP:
            cell.metadata.pop(key, None)
        if cell.cell_type != "code":
            continue
        cell.outputs, cell.execution_count = [], None
        new_source, hints = strip_source(cell.source, where=f"{name}, cell {i}")
        if hints:
            cell.source = new_source
            tags = list(cell.metadata.get("tags", []))
            if EXERCISE_TAG not in tags:
                cell.metadata["tags"] = tags + [EXERCISE_TAG]
    return out


def first_exercise_index(student_nb: nbformat.NotebookNode) -> int | None:
    """Index of the first cell of a learner copy that raises NotImplementedError (tagged `exercise`)."""
    for i, c in enumerate(student_nb.cells):
        if c.cell_type == "code" and EXERCISE_TAG in c.metadata.get("tags", []):
            return i
    return None


def lab_notebooks(labs_dir: Path) -> list[Path]:
    return sorted(p for p in Path(labs_dir).glob("*.ipynb") if not p.name.startswith("."))


def write_student_copies(labs_dir: Path, out_dir: Path, quiet: bool = False) -> list[Path]:
    """Write the learner copy of every lab in `labs_dir` into `out_dir` (plus the syllabus). Idempotent."""
    labs_dir, out_dir = Path(labs_dir).resolve(), Path(out_dir).resolve()
    if out_dir == labs_dir:
        raise ValueError(f"--out {out_dir} is the labs folder itself: that would overwrite the solutions")
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for src in lab_notebooks(labs_dir):
        nb = nbformat.read(src, as_version=4)
        student = make_student_notebook(nb, name=src.name)
        n_ex = len(exercise_cells(nb))
        dst = out_dir / src.name
        text = nbformat.writes(student) + "\n"
        if not dst.exists() or dst.read_text(encoding="utf-8") != text:
            dst.write_text(text, encoding="utf-8")
        written.append(dst)
        if not quiet:
            print(f"{src.name}: {n_ex} exercise cell(s) stripped -> {dst}")
    readme = labs_dir / "README.md"
    if readme.exists():
        shutil.copyfile(readme, out_dir / "README.md")
    if not written and not quiet:
        print(f"no notebooks in {labs_dir}")
    return written


def _run(args: argparse.Namespace) -> int:
    written = write_student_copies(args.labs_dir, args.out, quiet=args.quiet)
    if not args.quiet:
        print(f"{len(written)} learner cop{'y' if len(written) == 1 else 'ies'} in {Path(args.out).resolve()}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("student", help="write learner copies of the labs (solutions stripped)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO_ROOT / "student", help="output folder (default: student/)")
    p.add_argument("--labs-dir", type=Path, default=REPO_ROOT / "labs", help="source labs (default: labs/)")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_run)
