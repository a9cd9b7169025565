"""The labs whose claims are about time finish with their claims intact on a busy laptop: one busy process on each
core, the lab run in SMOKE mode beside them. Their timing claims compare A and B in interleaved rounds (or within
one run, as lab 03's stalls and lab 04's prefill costs do); a claim whose rounds disagree prints NOT JUDGED (with
how to rerun) instead of a false FAIL, and the claims that are not about time must still pass. The lab's own
measurement, not a unit test's, under the load a learner's browser, IDE and video call put on a 2-core machine."""
from __future__ import annotations

import multiprocessing as mp
import os
import re

import nbformat
import papermill
import pytest

from lab_utils.paths import REPO_ROOT

pytestmark = [pytest.mark.notebooks, pytest.mark.slow]


def _spin() -> None:
    while True:
        pass


@pytest.fixture
def busy_cores():
    """One spinning process per core (at normal priority, as a learner's other programs run), stopped after."""
    procs = [mp.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 2)]
    for p in procs:
        p.start()
    yield len(procs)
    for p in procs:
        p.kill()
        p.join(5)


def _claim_lines(nb) -> list[str]:
    lines = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text = out.get("text", "") if out.get("output_type") == "stream" else ""
            lines += [ln for ln in text.splitlines() if re.match(r"(PASS|FAIL|NOT JUDGED) ", ln)]
    return lines


@pytest.mark.timeout(1500)
# SMOKE under this load on a 2-core machine (measured): 03 25 s, 04 36 s, 13 97 s, 08 159 s
@pytest.mark.parametrize("lab", ["00_foundations", "01_continuous_batching", "03_chunked_prefill",
                                 "04_prefix_caching", "08_vllm_tuning", "13_structured_output"])
def test_lab_claims_hold_with_a_busy_process_on_each_core(lab, busy_cores, tmp_path, monkeypatch):
    out = tmp_path / f"{lab}.ipynb"
    monkeypatch.setenv("LAB_SMOKE", "1")  # the kernel inherits this process's environment
    monkeypatch.setenv("LAB_INTERACTIVE", "0")
    papermill.execute_notebook(str(REPO_ROOT / "labs" / f"{lab}.ipynb"), str(out), cwd=str(REPO_ROOT / "labs"),
                               parameters={"SMOKE": True, "INTERACTIVE": False}, progress_bar=False,
                               kernel_name="python3")
    lines = _claim_lines(nbformat.read(out, as_version=4))
    print(f"{lab} beside {busy_cores} busy processes:", *lines, sep="\n  ")
    assert lines, "the lab printed no claims"
    assert not [ln for ln in lines if ln.startswith("FAIL")], lines
    judged = [ln for ln in lines if ln.startswith("PASS")]
    assert len(judged) >= len(lines) // 2, f"most claims went unjudged under load: {lines}"
