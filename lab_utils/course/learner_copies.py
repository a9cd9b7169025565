"""Learner copies of the labs: every solution region becomes `raise NotImplementedError("<hint>")`.

    python -m lab_utils student --out student        (what `make student` runs)

In a lab, the reference solution of an exercise sits between two marker lines; the first comment inside is
the hint the learner sees:

    def rope(x, cos, sin):
        ### BEGIN SOLUTION
        # Hint: rotate pairs (i, i + D/2) ...
        return x * cos + rotate_half(x) * sin
        ### END SOLUTION

becomes, in the learner's copy of lab 00,

    def rope(x, cos, sin):
        # Stuck? from lab_utils.hints import hint; hint("00.rope") gives the idea, levels 2 and 3 more
        raise NotImplementedError("Hint: rotate pairs (i, i + D/2) ...")

The first comment states the exercise's contract, never its code (tests/unit/test_hints.py measures that). The
`hint` line names the exercise id, `<lab>.<function>`, whose three levels of help live in `lab_utils.hint_texts`.

Outputs and execution counts are cleared and cells that held a solution get the tag `exercise`. The transform
is a pure function of the source notebook, so running it twice writes the same bytes (idempotent), and running
it on a learner copy changes nothing. `--keep-existing` (what `make lab` runs) writes only the copies that are
missing, so a learner's work in `student/` is never overwritten.

    python -m lab_utils student --stats        (how much code the learner writes, per lab)

counts the learner-written lines: the lines inside solution regions, comments and blank lines excluded, and
the hints the learner asked for, per exercise (from `<out>/.lab_hints.json`, written by `lab_utils.hints.hint`).
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import nbformat

from lab_utils.hints import hints_log, hints_table
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


_DEF_RE = re.compile(r"^(?P<indent>[ \t]*)(?:async[ \t]+)?def[ \t]+(?P<name>\w+)")
_LAB_RE = re.compile(r"^(?P<lab>\d\d)_")


def lab_number(name: str) -> str | None:
    """`"02"` for `02_paged_kv_cache.ipynb`; None for a name without a lab number."""
    m = _LAB_RE.match(Path(name).name)
    return m.group("lab") if m else None


def region_function(source: str, region: Region) -> str | None:
    """Name of the function a solution region is the body of (the nearest `def` above it, less indented)."""
    lines = source.split("\n")
    for line in reversed(lines[:region.start]):
        m = _DEF_RE.match(line)
        if m and len(m.group("indent")) < len(region.indent):
            return m.group("name")
    return None


def exercise_id(lab: str | None, source: str, region: Region) -> str | None:
    """`"02.grow"`: the lab and the function a region implements; what `hint(...)` takes. None outside a lab or
    for a region that is not a function body."""
    name = region_function(source, region)
    return f"{lab}.{name}" if lab and name else None


def exercise_ids(nb: nbformat.NotebookNode, lab: str) -> list[str]:
    """Exercise ids of a lab's solution regions, in order."""
    ids = []
    for i in exercise_cells(nb):
        src = nb.cells[i].source
        ids += [x for r in find_regions(src, where=f"lab {lab}, cell {i}") if (x := exercise_id(lab, src, r))]
    return ids


def hint_line(indent: str, ex_id: str) -> str:
    """The one line of a learner copy's exercise that says how to ask for help."""
    return f'{indent}# Stuck? from lab_utils.hints import hint; hint("{ex_id}") gives the idea, levels 2 and 3 more'


def _raise_line(indent: str, hint: str) -> str:
    # json's string escapes (\" \\ \n \uXXXX) are valid Python string escapes
    return f"{indent}raise NotImplementedError({json.dumps(hint, ensure_ascii=False)})"


def strip_source(source: str, where: str = "cell", lab: str | None = None) -> tuple[str, list[str]]:
    """Replace each solution region of a cell's source; returns (new source, hints). With `lab`, each region
    that is a function's body also gets the line naming its hints (`hint_line`)."""
    regions = find_regions(source, where)
    if not regions:
        return source, []
    lines = source.split("\n")
    out: list[str] = []
    pos = 0
    for r in regions:
        out.extend(lines[pos:r.start])
        ex_id = exercise_id(lab, source, r)
        if ex_id:
            out.append(hint_line(r.indent, ex_id))
        out.append(_raise_line(r.indent, r.hint))
        pos = r.end + 1
    out.extend(lines[pos:])
    return "\n".join(out), [r.hint for r in regions]


def replace_solution(source: str, body: str, region: int = 0, where: str = "cell") -> str:
    """`source` with solution region number `region` replaced by `body` (re-indented to the region's indent),
    markers kept. How a test puts a deliberately wrong learner implementation into a lab."""
    regions = find_regions(source, where)
    if not 0 <= region < len(regions):
        raise IndexError(f"{where} has {len(regions)} solution region(s); there is no region {region}")
    r = regions[region]
    lines = source.split("\n")
    new = [r.indent + line if line.strip() else "" for line in textwrap.dedent(body).strip("\n").split("\n")]
    return "\n".join(lines[:r.start + 1] + new + lines[r.end:])


def inject_solution(nb: nbformat.NotebookNode, contains: str, body: str, region: int = 0) -> int:
    """Replace a solution region of the exercise cell whose source contains `contains` (in place); returns
    the cell's index. E.g. `inject_solution(nb, "def schedule_continuous", WRONG_BODY)` in a lab's test."""
    hits = [i for i in exercise_cells(nb) if contains in nb.cells[i].source]
    if len(hits) != 1:
        raise ValueError(f"{len(hits)} exercise cells contain {contains!r}; name exactly one")
    i = hits[0]
    nb.cells[i].source = replace_solution(nb.cells[i].source, body, region, where=f"cell {i}")
    return i


def is_exercise_source(source: str) -> bool:
    return any(_BEGIN_RE.match(line) for line in source.split("\n"))


def exercise_cells(nb: nbformat.NotebookNode) -> list[int]:
    """Indices of the code cells that hold a solution region (in the source lab)."""
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and is_exercise_source(c.source)]


def make_student_notebook(nb: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """The learner's copy of `nb` (a new object; `nb` is not modified)."""
    out = copy.deepcopy(nb)
    lab = lab_number(name)
    for key in _NB_META_DROP:
        out.metadata.pop(key, None)
    for i, cell in enumerate(out.cells):
        for key in _CELL_META_DROP:
            cell.metadata.pop(key, None)
        if cell.cell_type != "code":
            continue
        cell.outputs, cell.execution_count = [], None
        new_source, hints = strip_source(cell.source, where=f"{name}, cell {i}", lab=lab)
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


def write_student_copies(labs_dir: Path, out_dir: Path, quiet: bool = False,
                         keep_existing: bool = False) -> list[Path]:
    """Write the learner copy of every lab in `labs_dir` into `out_dir` (plus the syllabus). Idempotent.
    With `keep_existing`, a copy already in `out_dir` is left as it is (it holds the learner's work) and only
    missing copies are written; a kept copy that differs from a fresh one is named, with how to start over."""
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
        written.append(dst)
        if dst.exists() and keep_existing:
            if not quiet and dst.read_text(encoding="utf-8") != text:
                print(f"{src.name}: kept your copy {dst} (it differs from a fresh one; to start this lab over, "
                      f"delete it and run this again)")
            continue
        if not dst.exists() or dst.read_text(encoding="utf-8") != text:
            dst.write_text(text, encoding="utf-8")
        if not quiet:
            print(f"{src.name}: {n_ex} exercise cell(s) stripped -> {dst}")
    readme = labs_dir / "README.md"
    if readme.exists():
        (out_dir / "README.md").write_text(student_readme(readme.read_text(encoding="utf-8")), encoding="utf-8")
    if not written and not quiet:
        print(f"no notebooks in {labs_dir}")
    return written


STUDENT_README_HEAD = """\
# Your copies of the labs

This folder holds your copies of the labs, exercises open, written by `python -m lab_utils student` (`make lab`
writes only the copies you do not have yet). The solved notebooks are in the repository's `labs/` folder; the
parts you write are saved in `my_engine/` next to these notebooks. The syllabus follows.

"""


def student_readme(syllabus: str) -> str:
    """The learner folder's README: what this folder holds, then the syllabus."""
    return STUDENT_README_HEAD + syllabus


# -- how much code the learner writes ----------------------------------------------------------------------
CORE_LABS = ("00", "04")  # the engine core: the first and last lab of the one-day path


def code_lines(lines: list[str]) -> int:
    """Lines a learner writes: not blank, not a comment."""
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def exercise_sizes(nb: nbformat.NotebookNode, name: str = "notebook") -> list[int]:
    """Learner-written lines of each exercise cell of a lab (the code inside its solution regions), in order."""
    sizes = []
    for i in exercise_cells(nb):
        lines = nb.cells[i].source.split("\n")
        sizes.append(sum(code_lines(lines[r.start + 1:r.end])
                         for r in find_regions(nb.cells[i].source, where=f"{name}, cell {i}")))
    return sizes


@dataclass(frozen=True)
class LabStats:
    lab: str  # "00"
    name: str  # "00_foundations"
    sizes: tuple[int, ...]  # learner-written lines per exercise cell

    @property
    def lines(self) -> int:
        return sum(self.sizes)

    @property
    def largest(self) -> int:
        return max(self.sizes, default=0)


def lab_stats(labs_dir: Path) -> list[LabStats]:
    out = []
    for path in lab_notebooks(labs_dir):
        nb = nbformat.read(path, as_version=4)
        out.append(LabStats(path.stem.split("_", 1)[0], path.stem, tuple(exercise_sizes(nb, path.name))))
    return out


def _total(stats: list[LabStats]) -> tuple[int, int, int]:
    return sum(len(s.sizes) for s in stats), sum(s.lines for s in stats), max((s.largest for s in stats), default=0)


def core_stats(stats: list[LabStats]) -> list[LabStats]:
    return [s for s in stats if CORE_LABS[0] <= s.lab <= CORE_LABS[1]]


def stats_table(stats: list[LabStats]) -> str:
    """Per lab: exercises, learner-written lines, the largest exercise; then labs 00-04 and all labs."""
    rows = [f"{'lab':4s} {'notebook':30s} {'exercises':>9s} {'lines':>7s} {'largest':>8s}"]
    rows += [f"{s.lab:4s} {s.name:30s} {len(s.sizes):9d} {s.lines:7d} {s.largest:8d}" for s in stats]
    rows.append("-" * len(rows[0]))
    core = f"labs {CORE_LABS[0]}-{CORE_LABS[1]}"
    for label, group in ((core, core_stats(stats)), ("all labs (total)", stats)):
        n, lines, largest = _total(group)
        rows.append(f"{label:35s} {n:9d} {lines:7d} {largest:8d}")
    return "\n".join(rows)


def threshold_problems(stats: list[LabStats], min_total: int | None = None,
                       max_exercise: int | None = None) -> list[str]:
    """What misses the course's targets: at least `min_total` learner lines in labs 00-04, no exercise (any
    lab) above `max_exercise` lines. Empty when every target given is met."""
    problems = []
    core_lines = _total(core_stats(stats))[1]
    if min_total is not None and core_lines < min_total:
        problems.append(f"labs {CORE_LABS[0]}-{CORE_LABS[1]} have {core_lines} learner-written lines; "
                        f"the target is at least {min_total}")
    if max_exercise is not None:
        for s in stats:
            for k, n in enumerate(s.sizes):
                if n > max_exercise:
                    problems.append(f"{s.name}: exercise {k + 1} has {n} lines; the target is at most "
                                    f"{max_exercise} (split it)")
    return problems


def _stats(args: argparse.Namespace) -> int:
    stats = lab_stats(args.labs_dir)
    print(f"learner-written code in {args.labs_dir} (lines inside solution regions; comments and blank lines "
          f"excluded):")
    print(stats_table(stats))
    problems = threshold_problems(stats, args.min_total, args.max_exercise)
    for p in problems:
        print(f"below target: {p}")
    log = hints_log(args.out)
    print(f"\nhints asked (from {log}):")
    print(hints_table(log))
    return 1 if problems else 0


def _run(args: argparse.Namespace) -> int:
    if args.stats:
        return _stats(args)
    if args.min_total is not None or args.max_exercise is not None:
        raise SystemExit("--min-total and --max-exercise go with --stats")
    written = write_student_copies(args.labs_dir, args.out, quiet=args.quiet, keep_existing=args.keep_existing)
    if not args.quiet:
        print(f"{len(written)} learner cop{'y' if len(written) == 1 else 'ies'} in {Path(args.out).resolve()}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("student", help="write learner copies of the labs (solutions stripped)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO_ROOT / "student", help="output folder (default: student/)")
    p.add_argument("--labs-dir", type=Path, default=REPO_ROOT / "labs", help="source labs (default: labs/)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--keep-existing", action="store_true",
                   help="write only the missing copies; never overwrite one (it holds the learner's work)")
    p.add_argument("--stats", action="store_true",
                   help="print the learner-written lines per lab (no copies written)")
    p.add_argument("--min-total", type=int, metavar="N",
                   help=f"with --stats: exit 1 if labs {CORE_LABS[0]}-{CORE_LABS[1]} have fewer than N lines")
    p.add_argument("--max-exercise", type=int, metavar="N",
                   help="with --stats: exit 1 if an exercise has more than N lines")
    p.set_defaults(func=_run)
