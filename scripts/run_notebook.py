"""Execute a lab notebook without Jupyter: for a machine with no papermill, nbformat or ipykernel (the lent GPU
machine, DESIGN.md section 10). The notebook is plain JSON; its code cells run in order in one namespace, with
parameters set right after the `parameters` cell (as papermill injects them) and figures not shown.

    python scripts/run_notebook.py labs/00_foundations.ipynb -p SMOKE=True -p DEVICE='"cuda"' -p MODEL='"smollm2-135m-random"'

Exit 0 when every cell ran, 1 with the failing cell's number and traceback otherwise; `--report out.json` also
writes per-cell seconds, the failing cell, the engines' fast paths and fallbacks, recompiles and peak GPU memory. This is a smoke runner, not
a kernel: IPython magics are not supported (the labs use none).
"""
from __future__ import annotations

import argparse
import ast
import json
import linecache
import os
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


def _register_source(name: str, src: str) -> None:
    """Let `inspect.getsource` read a cell's functions, as IPython does (a lab's check saves the learner's
    function by its source)."""
    linecache.cache[name] = (len(src), None, src.splitlines(keepends=True), name)


class RunReport:
    """What a run took and did, for a GPU check's one line per lab (`--report PATH`, JSON): per-cell seconds, the
    failing cell and its error, the fast paths every engine ran (attention backend, CUDA graphs and their
    replays) and the ones that fell back, Dynamo's recompiles, the peak GPU memory."""

    def __init__(self) -> None:
        import weakref

        self.cells: dict[int, float] = {}
        self.failed_cell: int | None = None
        self.error: str | None = None
        self.engines: dict[int, dict] = {}
        self._runners: weakref.WeakSet = weakref.WeakSet()

    def track_engines(self) -> None:
        """Remember every ModelRunner built from now on (weakly: an engine a lab deletes is freed as before)."""
        try:
            from lab_utils.engine.model_runner import ModelRunner
        except ImportError:
            return
        init, runners = ModelRunner.__init__, self._runners

        def tracked_init(runner, *args, **kwargs):
            init(runner, *args, **kwargs)
            runners.add(runner)

        ModelRunner.__init__ = tracked_init

    def snapshot(self) -> None:
        """The live engines' fast paths, kept after they are gone."""
        for r in list(self._runners):
            g = getattr(r, "graphs", None)
            self.engines[id(r)] = {
                "device": str(getattr(r, "device", "")), "attention": getattr(r, "attention_backend", None),
                "graphs": g is not None, "graph_replays": getattr(g, "num_replays", 0) if g is not None else 0,
                "fallbacks": {k: str(v)[:200] for k, v in dict(getattr(r, "fast_path_errors", {}) or {}).items()}}

    def as_dict(self, passed: bool, seconds: float) -> dict:
        engines = list(self.engines.values())
        recompiles = None
        if "torch._dynamo" in sys.modules:
            from torch._dynamo.utils import counters

            recompiles = int(sum(counters.get("recompiles", {}).values()))
        peak = None
        if "torch" in sys.modules:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                peak = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        paths = sorted({f"{e['attention']}{'+graphs' if e['graphs'] else ''}" for e in engines})
        fallbacks = sorted({f"{k}: {v}" for e in engines for k, v in e["fallbacks"].items()})
        return {"passed": passed, "seconds": round(seconds, 2), "failed_cell": self.failed_cell, "error": self.error,
                "cells": self.cells, "engines": len(engines), "fast_paths": paths,
                "graph_replays": sum(e["graph_replays"] for e in engines), "fallbacks": fallbacks,
                "recompiles": recompiles, "peak_gpu_mib": peak}


def run(path: Path, params: dict[str, object], report: Path | None = None) -> int:
    """Run every code cell in the notebook's folder (as Jupyter does: the labs save parts beside themselves)."""
    path, report = path.resolve(), report.resolve() if report else None
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.chdir(path.parent)
    _quiet_figures()
    rep = RunReport()
    if report:
        rep.track_engines()
    ns: dict = {"__name__": "__main__", "display": lambda *a, **k: print(*a)}
    injected = "\n".join(f"{k} = {v!r}" for k, v in params.items())
    t0 = time.perf_counter()

    def done(passed: bool) -> int:
        if report:
            rep.snapshot()
            report.write_text(json.dumps(rep.as_dict(passed, time.perf_counter() - t0)))
        return 0 if passed else 1

    for i, src, tags in code_cells(path):
        if any(line.lstrip().startswith(("%", "!")) for line in src.splitlines()):
            print(f"[cell {i}] has IPython magics: not supported here", file=sys.stderr)
            rep.failed_cell, rep.error = i, "IPython magics are not supported"
            return done(False)
        t = time.perf_counter()
        try:
            name = f"<{path.name}[cell {i}]>"
            _register_source(name, src)
            exec(compile(src, name, "exec"), ns)
            if "parameters" in tags and injected:
                exec(injected, ns)
        except BaseException as err:
            traceback.print_exc()
            print(f"FAILED {path.name} at cell {i} after {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            rep.failed_cell, rep.error = i, f"{type(err).__name__}: {str(err)[:1000]}"
            return done(False)
        rep.cells[i] = round(time.perf_counter() - t, 2)
        if report:
            rep.snapshot()
        print(f"[cell {i}] {time.perf_counter() - t:.1f} s", file=sys.stderr)
    print(f"PASSED {path.name} in {time.perf_counter() - t0:.1f} s")
    return done(True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebook", type=Path)
    ap.add_argument("-p", "--param", action="append", default=[], metavar="NAME=PYTHON_LITERAL")
    ap.add_argument("--report", type=Path, help="write what the run took and did here (JSON; see RunReport)")
    a = ap.parse_args(argv)
    params = {}
    for p in a.param:
        name, _, value = p.partition("=")
        params[name] = ast.literal_eval(value)
    return run(a.notebook, params, a.report)


if __name__ == "__main__":
    raise SystemExit(main())
