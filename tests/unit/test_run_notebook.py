"""scripts/run_notebook.py: a lab notebook executed without Jupyter (the lent GPU machine has none)."""
from __future__ import annotations

import json
import subprocess
import sys

from lab_utils.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "run_notebook.py"


def _nb(tmp_path, cells):
    nb = {"cells": [{"cell_type": "code", "source": src, "metadata": {"tags": tags}, "outputs": []}
                    for src, tags in cells] + [{"cell_type": "markdown", "source": "# text", "metadata": {}}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    p = tmp_path / "nb.ipynb"
    p.write_text(json.dumps(nb))
    return p


def _run(path, *params):
    return subprocess.run([sys.executable, str(SCRIPT), str(path), *sum((["-p", p] for p in params), [])],
                          capture_output=True, text=True, timeout=120)


def test_parameters_are_injected_after_the_parameters_cell(tmp_path):
    p = _nb(tmp_path, [("SMOKE = False\nMODEL = 'real'", ["parameters"]),
                       ("assert SMOKE is True and MODEL == 'random', (SMOKE, MODEL)\nprint('ran', MODEL)", [])])
    r = _run(p, "SMOKE=True", "MODEL='random'")
    assert r.returncode == 0 and "ran random" in r.stdout and "PASSED" in r.stdout, r.stderr


def test_a_failing_cell_fails_with_its_number(tmp_path):
    p = _nb(tmp_path, [("x = 1", ["parameters"]), ("import plotly.graph_objects as go\ngo.Figure().show()", []),
                       ("raise ValueError('boom')", [])])
    r = _run(p)
    assert r.returncode == 1 and "at cell 2" in r.stderr and "boom" in r.stderr


def test_cells_run_beside_the_notebook_and_their_functions_have_source(tmp_path):
    """As in Jupyter: the notebook's folder is the working directory (the labs save the learner's parts beside
    themselves), and `inspect.getsource` reads a function defined in a cell (the checks save it by its source)."""
    p = _nb(tmp_path, [("x = 1", ["parameters"]),
                       ("import inspect, os\ndef part(a):\n    return a + 1\n"
                        "print('cwd', os.getcwd())\nprint('src', inspect.getsource(part).splitlines()[0])", [])])
    r = subprocess.run([sys.executable, str(SCRIPT), str(p)], capture_output=True, text=True, timeout=120,
                       cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr
    assert f"cwd {tmp_path}" in r.stdout and "src def part(a):" in r.stdout


def test_the_report_names_the_failing_cell_the_engines_fast_paths_and_their_fallbacks(tmp_path):
    engine = ("from lab_utils import EngineConfig, LLMEngine, SamplingParams, load_model\n"
              "eng = LLMEngine(load_model('tiny-random', device='cpu'), EngineConfig(kv_cache_memory_bytes=8 << 20),"
              " device='cpu')\n"
              "eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2))\n"
              "eng.runner.fast_path_errors['flex'] = 'LoweringException: injected'\n")
    p = _nb(tmp_path, [("x = 1", ["parameters"]), (engine, []), ("del eng\nraise ValueError('boom')", [])])
    out = tmp_path / "report.json"
    r = subprocess.run([sys.executable, str(SCRIPT), str(p), "--report", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1
    rep = json.loads(out.read_text())
    assert rep["passed"] is False and rep["failed_cell"] == 2 and rep["error"] == "ValueError: boom"
    assert set(rep["cells"]) == {"0", "1"} and rep["engines"] == 1  # the engine deleted in cell 2 is still counted
    assert rep["fast_paths"] and rep["fallbacks"] == ["flex: LoweringException: injected"]
    assert rep["peak_gpu_mib"] is None  # no CUDA here
