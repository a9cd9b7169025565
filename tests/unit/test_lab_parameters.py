"""Every lab's papermill parameters work as papermill users expect: the `parameters` cell holds only literal
assignments (so papermill's injected cell, which lands right after it, overrides them), it declares every name
run-labs passes (no "unknown parameter" warning), and `-p SMOKE True` gives the same sizes as `LAB_SMOKE=1`.

Cheap by design: only the parameters cell, papermill's injected cell and the next (derivation) cell run, with
exec() in a plain namespace; no lab is executed.
"""
from __future__ import annotations

import ast
import copy
import types

import pytest

from lab_utils.labs_runner import LABS_DIR, lab_parameters
from lab_utils.params import env_choice, env_flag, sizer

nbformat = pytest.importorskip("nbformat")
papermill = pytest.importorskip("papermill")
from papermill.iorw import load_notebook_node
from papermill.parameterize import parameterize_notebook
from papermill.translators import PythonTranslator

LABS = sorted(LABS_DIR.glob("[0-9][0-9]_*.ipynb"))
ENV = ("LAB_SMOKE", "LAB_INTERACTIVE", "LAB_DTYPE")


def params_index(nb) -> int:
    hits = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(hits) == 1, f"one cell tagged 'parameters', found {len(hits)}"
    assert nb.cells[hits[0]].cell_type == "code"
    return hits[0]


def declared(source: str) -> list[str]:
    names = []
    for st in ast.parse(source).body:
        for t in st.targets:
            names += [e.id for e in t.elts] if isinstance(t, ast.Tuple) else [t.id]
    return names


def run_settings(nb, parameters: dict | None) -> dict:
    """The lab's namespace after its parameters cell, papermill's injected cell (when `parameters` are given) and
    the derivation cell that follows."""
    if parameters is not None:
        nb = parameterize_notebook(copy.deepcopy(nb), parameters, kernel_name="python3", language="python")
    i = params_index(nb)
    injected = parameters is not None
    if injected:
        assert "injected-parameters" in nb.cells[i + 1].metadata.get("tags", [])
    cells = nb.cells[i:i + 2 + injected]  # parameters, [injected,] derivation
    assert cells[-1].cell_type == "code", "the cell after the parameters derives the sizes; it must be code"
    ns: dict = {}
    for c in cells:
        exec(compile(c.source, "<cell>", "exec"), ns)  # noqa: S102 - the lab's own cells, as a kernel would run them
    return {k: v for k, v in ns.items() if not k.startswith("__") and not callable(v)
            and not isinstance(v, types.ModuleType)}


@pytest.fixture
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_every_lab_is_checked():
    assert len(LABS) >= 14


@pytest.mark.parametrize("lab", LABS, ids=[p.stem for p in LABS])
def test_parameters_cell_holds_only_literal_assignments(lab):
    nb = load_notebook_node(str(lab))
    cell = nb.cells[params_index(nb)]
    for st in ast.parse(cell.source).body:
        what = ast.get_source_segment(cell.source, st)
        assert isinstance(st, ast.Assign), f"{lab.name}: the parameters cell holds assignments only, not {what!r}"
        assert all(isinstance(t, (ast.Name, ast.Tuple)) for t in st.targets), what
        try:
            ast.literal_eval(st.value)
        except ValueError:
            pytest.fail(f"{lab.name}: {what!r} is not a literal; derive it in the next cell, or papermill's "
                        f"injected values (which land after this cell) do not reach it")


@pytest.mark.parametrize("lab", LABS, ids=[p.stem for p in LABS])
def test_papermill_sees_every_parameter_run_labs_passes(lab):
    nb = load_notebook_node(str(lab))
    cell = nb.cells[params_index(nb)]
    seen = {p.name for p in PythonTranslator.inspect(cell)}
    assert seen == set(declared(cell.source)), (
        f"{lab.name}: papermill cannot parse {sorted(set(declared(cell.source)) - seen)} (an '=' in a comment?)")
    missing = set(lab_parameters(smoke=True, device="cpu")) - seen
    assert not missing, f"{lab.name}: run-labs passes {sorted(missing)}: papermill warns 'Passed unknown parameter'"


@pytest.mark.parametrize("lab", LABS, ids=[p.stem for p in LABS])
def test_papermill_smoke_gives_the_smoke_sizes(lab, clean_env):
    nb = load_notebook_node(str(lab))
    full = run_settings(nb, None)
    assert full["SMOKE"] is False and full["INTERACTIVE"] is True
    by_papermill = run_settings(nb, {"SMOKE": True})
    clean_env.setenv("LAB_SMOKE", "1")
    by_env = run_settings(nb, None)
    assert by_papermill["SMOKE"] is True and by_env["SMOKE"] is True
    assert by_papermill == by_env, f"{lab.name}: -p SMOKE True and LAB_SMOKE=1 give different settings"
    changed = sorted(k for k in full if k != "SMOKE" and full[k] != by_env[k])
    assert changed, f"{lab.name}: SMOKE changes no size"


@pytest.mark.parametrize("lab", LABS, ids=[p.stem for p in LABS])
def test_a_size_passed_by_papermill_wins_over_the_smoke_default(lab, clean_env):
    nb = load_notebook_node(str(lab))
    cell = nb.cells[params_index(nb)]
    sizes = [n for n, v in zip(declared(cell.source), _values(cell.source)) if v is None]
    if not sizes:
        pytest.skip("no size derived from SMOKE")
    name = sizes[0]
    given = run_settings(nb, {"SMOKE": True, name: 3})
    assert given[name] == 3 and given["SMOKE"] is True


def _values(source: str) -> list:
    out = []
    for st in ast.parse(source).body:
        v = ast.literal_eval(st.value)
        out += list(v) if isinstance(st.targets[0], ast.Tuple) else [v]
    return out


def test_run_labs_parameters_turn_widgets_off(clean_env):
    lab = next(p for p in LABS if p.name.startswith("00_"))
    ns = run_settings(load_notebook_node(str(lab)), lab_parameters(smoke=False, device="cpu"))
    assert ns["INTERACTIVE"] is False and ns["SMOKE"] is False and ns["DEVICE"] == "cpu"


# ------------------------------------------------------------------------------------- lab_utils.params
def test_env_flag(monkeypatch):
    monkeypatch.delenv("LAB_X", raising=False)
    assert env_flag("LAB_X") is False and env_flag("LAB_X", default=True) is True
    for value, want in [("1", True), ("true", True), ("0", False), ("no", False), ("", False)]:
        monkeypatch.setenv("LAB_X", value)
        assert env_flag("LAB_X") is want, value
    monkeypatch.setenv("LAB_X", "maybe")
    with pytest.raises(ValueError, match="LAB_X='maybe'"):
        env_flag("LAB_X")


def test_env_choice_only_fills_auto(monkeypatch):
    monkeypatch.setenv("LAB_DTYPE", "bfloat16")
    assert env_choice("LAB_DTYPE", "auto") == "bfloat16"
    assert env_choice("LAB_DTYPE", "float32") == "float32"  # passed explicitly: wins over the environment
    monkeypatch.delenv("LAB_DTYPE")
    assert env_choice("LAB_DTYPE", "auto") == "auto"


def test_sizer():
    assert sizer(True)(None, smoke=4, full=8) == 4 and sizer(False)(None, smoke=4, full=8) == 8
    assert sizer(True)(16, smoke=4, full=8) == 16 and sizer(True)(False, smoke=True, full=True) is False
