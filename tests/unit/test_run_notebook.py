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
