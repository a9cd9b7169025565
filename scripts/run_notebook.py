"""Execute a lab notebook without Jupyter: for a machine with no papermill, nbformat or ipykernel (the lent GPU
machine, DESIGN.md section 10). The notebook is plain JSON; its code cells run in order in one namespace, with
parameters set right after the `parameters` cell (as papermill injects them) and figures not shown.

    python scripts/run_notebook.py labs/00_foundations.ipynb -p SMOKE=True -p DEVICE='"cuda"' -p MODEL='"smollm2-135m-random"'

Exit 0 when every cell ran, 1 with the failing cell's number and traceback otherwise. This is a smoke runner, not
a kernel: IPython magics are not supported (the labs use none).
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
import time
import traceback
from pathlib import Path


def code_cells(path: Path) -> list[tuple[int, str, list[str]]]:
    """(index, source, tags) of every code cell."""
    nb = json.loads(path.read_text())
    out = []
    for i, c in enumerate(nb["cells"]):
        if c.get("cell_type") == "code":
            src = c["source"] if isinstance(c["source"], str) else "".join(c["source"])
            out.append((i, src, list(c.get("metadata", {}).get("tags", []))))
    return out


def _quiet_figures() -> None:
    try:
        import plotly.basedatatypes as bdt
    except ImportError:
        return
    bdt.BaseFigure.show = lambda self, *a, **k: None


def run(path: Path, params: dict[str, object]) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    _quiet_figures()
    ns: dict = {"__name__": "__main__", "display": lambda *a, **k: print(*a)}
    injected = "\n".join(f"{k} = {v!r}" for k, v in params.items())
    t0 = time.perf_counter()
    for i, src, tags in code_cells(path):
        if any(line.lstrip().startswith(("%", "!")) for line in src.splitlines()):
            print(f"[cell {i}] has IPython magics: not supported here", file=sys.stderr)
            return 1
        t = time.perf_counter()
        try:
            exec(compile(src, f"{path.name}[cell {i}]", "exec"), ns)
            if "parameters" in tags and injected:
                exec(injected, ns)
        except BaseException:
            traceback.print_exc()
            print(f"FAILED {path.name} at cell {i} after {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            return 1
        print(f"[cell {i}] {time.perf_counter() - t:.1f} s", file=sys.stderr)
    print(f"PASSED {path.name} in {time.perf_counter() - t0:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebook", type=Path)
    ap.add_argument("-p", "--param", action="append", default=[], metavar="NAME=PYTHON_LITERAL")
    a = ap.parse_args(argv)
    params = {}
    for p in a.param:
        name, _, value = p.partition("=")
        params[name] = ast.literal_eval(value)
    return run(a.notebook, params)


if __name__ == "__main__":
    raise SystemExit(main())
