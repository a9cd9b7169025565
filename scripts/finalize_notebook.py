"""Make a lab ready to commit: execute it in SMOKE mode, keep outputs only on `# NBVAL_CHECK_OUTPUT` cells.

    python scripts/finalize_notebook.py labs/05_quantization.ipynb [--keep-all]

nbval (`--nbval-lax`) compares only cells that carry that marker and stored outputs, so those outputs must come
from the same SMOKE run CI does. Everything else is stripped, which keeps diffs and the repo small.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import nbformat
import papermill as pm

MARK = "NBVAL_CHECK_OUTPUT"


def finalize(path: Path, keep_all: bool = False) -> None:
    os.environ.update(LAB_SMOKE="1", LAB_INTERACTIVE="0", HF_HUB_OFFLINE="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / path.name
        pm.execute_notebook(str(path), str(out), cwd=str(path.parent), progress_bar=False, kernel_name="python3")
        executed = nbformat.read(out, as_version=4)
    src = nbformat.read(path, as_version=4)
    by_id = {c.get("id"): c for c in executed.cells}
    for cell in src.cells:
        if cell.cell_type != "code":
            continue
        ran = by_id.get(cell.get("id"))
        if ran is not None and (keep_all or MARK in cell.source):
            cell.outputs, cell.execution_count = ran.outputs, ran.execution_count
        else:
            cell.outputs, cell.execution_count = [], None
    # a kernelspec spares JupyterLab's "select a kernel" dialog and papermill's guess
    src.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    src.metadata.setdefault("language_info", {"name": "python"})
    nbformat.write(src, path)
    print(f"finalized {path}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--keep-all", action="store_true", help="keep every output (small notebooks only)")
    a = ap.parse_args()
    for nb in a.notebooks:
        finalize(nb, a.keep_all)
    sys.exit(0)
