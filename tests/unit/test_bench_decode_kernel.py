"""benchmarks/decode_kernel.py runs end to end (tiny shapes): every path timed against its bound, the split-KV
gain computed, and the GPU goals left unjudged off a GPU (the interpreter's speed says nothing about them)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lab_utils.kernels import triton_env
from lab_utils.paths import REPO_ROOT


@pytest.mark.skipif(not triton_env.available(), reason=triton_env.SKIP)
def test_quick_run_writes_its_json(tmp_path):
    out = tmp_path / "dk.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "decode_kernel.py"), "--quick",
                           "--num-splits", "4", "--repeats", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert [x["path"] for x in r["rows"]][:1] == ["reference_kernel"] and len(r["rows"]) == 5
    assert all(x["us"] > 0 and 0 < x["fraction_of_bound"] <= 1 for x in r["rows"])
    assert r["split_gain"] > 0 and "split-KV gain" in proc.stdout
    if r["device"] == "cpu":
        assert r["goals"] is None and "interpreter" in r["goals_note"]
    else:
        assert set(r["goals"]) == {"reference_fraction_ge_0.70", "reference_not_slower_than_flex", "split_gain_ge_2x"}
