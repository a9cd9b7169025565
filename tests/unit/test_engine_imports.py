"""The map's guard: which part of lab_utils may import which, read from the source (every import, those inside
functions included, as an `ast` walk sees them). A new arrow the wrong way fails here with its file and line.

Rules:
- the engine (`lab_utils/engine/`) imports nothing course-side: the course, the checks, the server, the
  workshop, and the notebooks' helpers (quiz, hints, the labs runner, plots);
- no circle between lab_utils' sub-packages (`lab_utils.X` for each folder or module X): if X imports Y, Y
  never reaches X. The arrows that still close a circle today are listed, each with why it is still there, in
  `OPEN_TIES`: the test fails on any other circle, and on a listed arrow that is gone (take it off the list);
- no circle between the modules of the checks (a lab module calls the generic grader, never the other way).
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lab_utils"
COURSE_SIDE = ("course", "checks", "server", "workshop", "quiz", "hints", "hint_texts", "labs_runner", "viz")
# arrows that close a circle between sub-packages today (the wrong-way arrow of each tie) -> why it is not cut yet
OPEN_TIES = {
    ("lab_utils.engine", "lab_utils.speculative"): "features.py builds the speculative hook from "
    "EngineConfig.speculative, and the hook is made of the engine's own pieces (hooks, sampler, paging, the draft's "
    "fast linears): the engine has to be given its feature builders instead of naming them",
}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file, relative ones resolved. `from a import b` counts as
    an import of `a.b` when `a/b` is a module or package here, else of `a`."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path, root).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = root / Path(*f"{base}.{a.name}".split("."))
                found.append((f"{base}.{a.name}" if sub.with_suffix(".py").exists() or sub.is_dir() else base,
                              node.lineno))
    return [(m, line) for m, line in found if m == "lab_utils" or m.startswith("lab_utils.")]


def all_imports(root: Path = ROOT) -> list[tuple[str, str, int, str]]:
    """(importing module, imported module, line, file) over every module of lab_utils under `root`."""
    rows = []
    for path in sorted((root / "lab_utils").rglob("*.py")):
        rows += [(module_name(path, root), target, line, str(path.relative_to(root)))
                 for target, line in imports_of(path, root)]
    return rows


def part_of(module: str) -> str | None:
    """`lab_utils.X` for a module of lab_utils' sub-package (or top-level module) X; None for lab_utils itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else None


def circles(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def graph(rows, node) -> dict[str, dict[str, str]]:
    """node(module) -> {node(imported): the first file:line of such an import}, self-arrows left out."""
    edges: dict[str, dict[str, str]] = defaultdict(dict)
    for source, target, line, file in rows:
        a, b = node(source), node(target)
        if a and b and a != b:
            edges[a].setdefault(b, f"{file}:{line}")
    return edges


def circle_report(edges: dict[str, dict[str, str]]) -> str:
    """'' without circles, else each circle with the arrows inside it (file:line of each)."""
    lines = []
    for comp in circles(edges):
        lines.append(" <-> ".join(comp))
        lines += [f"  {a} -> {b} ({where})" for a in comp for b, where in sorted(edges.get(a, {}).items()) if b in comp]
    return "\n".join(lines)


def engine_arrows_up(rows) -> list[str]:
    return [f"{file}:{line} imports {target}" for source, target, line, file in rows
            if source.startswith("lab_utils.engine") and (part_of(target) or "").removeprefix("lab_utils.") in COURSE_SIDE]


def test_the_engine_imports_nothing_course_side():
    bad = engine_arrows_up(all_imports())
    assert not bad, ("the engine must not import the course side (the course calls down into the engine, never the "
                     "other way):\n" + "\n".join(bad))


def test_no_circle_between_sub_packages():
    edges = graph(all_imports(), part_of)
    gone = [f"{a} -> {b}" for a, b in OPEN_TIES if b not in edges.get(a, {})]
    assert not gone, f"these open ties are cut now: take them off OPEN_TIES: {gone}"
    for a, b in OPEN_TIES:
        del edges[a][b]
    report = circle_report(edges)
    assert not report, "import circles between lab_utils' sub-packages (one arrow of each must go):\n" + report


def test_the_structured_hook_answers_every_step_hook_method():
    """lab_utils.structured sits under the engine (it imports none of it), so its hook answers the engine's
    StepHook by name, with as many parameters."""
    import inspect

    from lab_utils.engine.hooks import StepHook
    from lab_utils.structured.hook import StructuredOutputs

    for name, method in vars(StepHook).items():
        if callable(method) and not name.startswith("_"):
            ours = getattr(StructuredOutputs, name, None)
            assert ours is not None, f"StructuredOutputs lacks StepHook.{name}"
            # the engine passes them by position: the same number
            assert len(inspect.signature(ours).parameters) == len(inspect.signature(method).parameters), name


def test_the_lab14_check_names_its_part_as_the_grader_does():
    from lab_utils.checks import lab14, parts_check

    assert lab14._where() == parts_check.where(lab14.PART)


def test_no_circle_between_the_checks_modules():
    report = circle_report(graph(all_imports(), lambda m: m if m.startswith("lab_utils.checks.") else None))
    assert not report, "import circles between the checks' modules:\n" + report


def test_the_guard_sees_a_planted_arrow_back_with_its_file_and_line(tmp_path):
    pkg = tmp_path / "lab_utils"
    for folder in ("engine", "quant", "checks"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "engine" / "runner.py").write_text("import torch\n\nfrom lab_utils.quant import linear\n")
    (pkg / "quant" / "linear.py").write_text("")
    (pkg / "checks" / "lab01.py").write_text("from lab_utils.engine.runner import x\n")
    rows = all_imports(tmp_path)
    assert not engine_arrows_up(rows) and not circle_report(graph(rows, part_of))
    (pkg / "quant" / "kv.py").write_text("def f():\n    from lab_utils.engine import runner\n")  # inside a function
    (pkg / "engine" / "guards.py").write_text("from ..checks.lab01 import y\n")  # relative
    rows = all_imports(tmp_path)
    assert engine_arrows_up(rows) == ["lab_utils/engine/guards.py:1 imports lab_utils.checks.lab01"]
    report = circle_report(graph(rows, part_of))
    assert "lab_utils.engine <-> lab_utils.quant" in report and "lab_utils/quant/kv.py:2" in report
