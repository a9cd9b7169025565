"""scripts/gpu_check.sh rehearsed on a CPU as the lent GPU machine would run it (`--rehearse`: toy sizes, an empty
LAB_UTILS_CACHE, the packages that machine lacks unimportable in every process): every stage gives rows, what
comes back fits (at most 8 files of under 16 MiB), the run keeps its budget, the table comes last. A failing or
timed-out stage fails the script and keeps its rows; a fast path that fell back fails its stage; without CUDA the
real check refuses to pass."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab_utils.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu_check.sh"
MAX_FILES, MAX_BYTES = 8, 16 << 20  # what comes back from the lent machine's $OUT


def _run(tmp_path: Path, *args: str, **env) -> subprocess.CompletedProcess:
    e = {**os.environ, "OUT_DIR": str(tmp_path), **env}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO_ROOT, env=e, capture_output=True, text=True,
                          timeout=900)


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO_ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_rehearsal_of_the_lent_machine_gives_every_stage_rows_within_its_limits(tmp_path):
    r = _run(tmp_path, "--rehearse")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    stages = results["stages"]
    gc = _gpu_check()
    assert list(stages) == list(gc.STAGES)
    # honest skips, each with its reason; every other stage passed with rows
    assert stages["kv_sizing"]["status"] == "skipped" and stages["kv_sizing"]["figures"]["reason"].startswith("needs CUDA")
    for name, st in stages.items():
        if name != "kv_sizing":
            assert st["status"] == "passed" and st["rows"], (name, st)
    # the labs stage: three labs with random weights, one line each, vLLM skipped with its reason
    labs = stages["labs"]
    assert [row["lab"][:2] for row in labs["rows"]] != [] and {row["lab"][:2] for row in labs["rows"]} == {"02", "03", "11"}
    assert labs["figures"]["model"] == "smollm2-135m-random" and labs["figures"]["vllm"].startswith("skipped: vLLM cannot")
    for row in labs["rows"]:
        assert row["status"] == "passed" and row["failed_cell"] is None and row["claims"], row
        assert all(c.startswith(("PASS", "NOT JUDGED")) for c in row["claims"]), row["claims"]
        assert {"fast_paths", "fallbacks", "recompiles", "peak_gpu_mib", "seconds"} <= set(row)
    # the lent machine's conditions held in the stage processes and their children
    env = stages["env"]
    assert env["figures"]["cache_entries"] == 0 and env["figures"]["lab_utils_cache"] != str(Path.home() / ".cache" / "lab_utils")
    assert Path(env["figures"]["repo_root"]) != REPO_ROOT  # ran from a copy of what travels
    assert {row["package"] for row in env["rows"]} == set(gc.LENT_MACHINE_LACKS)
    assert not any(row["importable"] or row["importable_in_child"] for row in env["rows"]), env["rows"]
    assert "torch" in results["lent_machine_imports"]  # the baseline of what the lent machine has (warmup)
    assert "torch" not in env["figures"] or env["seconds"] < 10  # the env stage imports no torch: it is quick
    for name, st in stages.items():  # no stage imports beyond it (e.g. xgrammar, fastapi, plotly)
        assert "imports_beyond_lent_machine" not in st["figures"], (name, st["figures"])
    # figures mean their labels
    hf = stages["hf_match"]["rows"][0]
    assert hf["equal"] + hf["near_ties"] == hf["prompts"] == 4
    bf = stages["bf16_tokens"]["rows"][0]
    assert bf["partings"] == 0 and bf["graphs"] and bf["attention"] == "flex" and bf["decode_steps_on_graphs"] > 0
    for row in stages["throughput"]["rows"]:
        assert row["rows_per_step"] == f"{row['batch']}-{row['batch']}" and not row["fast_path_errors"]
    assert {row["batch"] for row in stages["throughput"]["rows"]} == {2, 4}
    assert stages["bandwidth"]["figures"]["copy_bandwidth_GBps"] > 0
    # the profile: kernels (on a CPU, aten ops) per decode step and the costliest, at batch 1 and the largest batch
    prof = stages["profile"]
    assert [row["batch"] for row in prof["rows"]] == [1, 4]
    for row in prof["rows"]:
        assert row["kernels_per_step"] > 0 and 0 < row["device_us_per_step"] and row["top3"]
    assert all(len(top) == 10 and top[0]["us_per_step"] >= top[-1]["us_per_step"]
               for top in prof["top_kernels"].values())
    # what comes back, the budget, the table last
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) <= MAX_FILES and all(p.stat().st_size < MAX_BYTES for p in files), files
    assert results["budget_seconds"] == 540 and results["total_seconds"] <= 540
    tail = r.stdout.strip().splitlines()
    assert tail[-1].startswith("GPU CHECK PASSED") and tail[-2].startswith("total ")
    assert "bf16_tokens" in (tmp_path / "table.txt").read_text() and "GPU CHECK PASSED" in (tmp_path / "log.txt").read_text()


def test_a_failing_stage_fails_the_script(tmp_path):
    r = _run(tmp_path, "--rehearse", GPU_CHECK_STAGES="env:60", GPU_CHECK_ARGS="--fail-stage env")
    assert r.returncode == 1 and "GPU CHECK FAILED" in r.stdout
    rec = json.loads((tmp_path / "results.json").read_text())["stages"]["env"]
    assert rec["status"] == "failed" and "injected" in rec["error"]


def test_a_timed_out_stage_fails_the_script_and_keeps_its_record(tmp_path):
    r = _run(tmp_path, "--rehearse", GPU_CHECK_STAGES="warmup:1")  # torch's import alone takes longer
    assert r.returncode == 1 and "TIMED OUT" in r.stdout
    rec = json.loads((tmp_path / "results.json").read_text())["stages"]["warmup"]
    assert rec["status"] == "failed" and rec["error"].startswith("timed out after 1 s")


def test_a_killed_stage_keeps_the_rows_it_wrote(tmp_path):
    gc = _gpu_check()
    rec = gc.Record(tmp_path, "throughput", "cpu", "tiny")
    rec.row(batch=2, output_tokens_per_s=1.0)
    assert json.loads((tmp_path / "results.json").read_text())["stages"]["throughput"]["status"] == "running"
    gc.mark_timeout(tmp_path, "throughput", 110)
    st = json.loads((tmp_path / "results.json").read_text())["stages"]["throughput"]
    assert st["status"] == "failed" and st["rows"] == [{"batch": 2, "output_tokens_per_s": 1.0}]
    assert "1 rows kept" in st["error"] and "throughput" in gc.table(tmp_path)


def test_timed_steps_must_hold_the_whole_batch_and_fast_path_fallbacks_fail(monkeypatch):
    from lab_utils import EngineConfig, LLMEngine, load_model
    from lab_utils.bench import decode_window as dw

    gc = _gpu_check()
    model, tok = load_model("tiny-random", device="cpu")
    eng = LLMEngine((model, tok), EngineConfig(max_num_seqs=4, kv_cache_memory_bytes=16 << 20), device="cpu")
    w = gc.decode_window(eng, 4, 16, 3)
    assert w["rows"] == [4, 4, 4] and w["tokens_per_s"] == pytest.approx(12 / sum(w["seconds"]))
    assert w["replay_s"] is None  # no captured graph on a CPU
    gc.require_fast_paths(eng, eager=False)
    # requests that end inside the window would shrink the batch: the step log catches it
    monkeypatch.setattr(dw, "window_tokens", lambda *a, **k: 3)
    with pytest.raises(AssertionError, match="not all 4 decode rows"):
        gc.decode_window(eng, 4, 16, 3)
    eng.runner.fast_path_errors["flex"] = "LoweringException: ..."
    with pytest.raises(AssertionError, match="fell back"):
        gc.require_fast_paths(eng, eager=False)


def test_kv_sizing_reads_the_share_the_engines_error_advises():
    from lab_utils.engine.kv.kv_budget import GiB, DeviceMemory, kv_cache_budget

    gc = _gpu_check()
    # an H200 with a first engine at 0.6 of it: 55 GiB free for a second one that asks for 0.6 again
    mem = DeviceMemory(total=int(139.8 * GiB), free=55 * GiB, weights=270 << 20, activations=300 << 20)
    with pytest.raises(ValueError) as err:
        kv_cache_budget(mem, gc.KV_SHARE)
    share = gc.advised_share(str(err.value))
    assert share is not None and 0.3 < share < gc.KV_SHARE
    assert kv_cache_budget(mem, share - 0.02) <= mem.free  # the advised share, a little under, fits
    assert gc.advised_share("CUDA out of memory") is None


def test_without_cuda_the_real_check_refuses_to_pass(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    r = _run(tmp_path, DEVICE="cuda")
    assert r.returncode == 2 and "needs CUDA" in r.stdout


def test_unit_rows_are_written_as_each_test_ends(tmp_path):
    """The unit stage's pytest plugin: one row a test, appended when it ends (a killed stage keeps them)."""
    (tmp_path / "test_x.py").write_text("import pytest\n"
                                        "def test_ok():\n    pass\n"
                                        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
                                        "@pytest.mark.skip(reason='no')\ndef test_skipped():\n    pass\n")
    rows = tmp_path / "rows.jsonl"
    env = {**os.environ, "GPU_CHECK_ROWS": str(rows), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           "PYTHONPATH": str(REPO_ROOT / "scripts" / "gpu_check_plugins")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "pytest_rows", "-p", "no:cacheprovider",
                        str(tmp_path / "test_x.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stdout
    got = {row["test"]: row for row in map(json.loads, rows.read_text().splitlines())}
    assert {k: v["outcome"] for k, v in got.items()} == {"test_ok": "passed", "test_bad": "failed",
                                                         "test_skipped": "skipped"}
    assert "one is not two" in got["test_bad"]["error"]


def test_the_labs_stage_cuts_what_its_deadline_leaves_no_time_for(tmp_path):
    """A deadline too short to start a lab: each lab is recorded as cut, and the stage fails naming them."""
    r = subprocess.run([sys.executable, "scripts/gpu_check.py", "--stage", "labs", "--device", "cpu", "--size",
                        "tiny", "--out", str(tmp_path), "--labs", "02", "03", "--labs-deadline", "1"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    st = json.loads((tmp_path / "results.json").read_text())["stages"]["labs"]
    assert st["status"] == "failed" and [row["status"] for row in st["rows"]] == ["cut", "cut"]
    assert "03_chunked_prefill cut" in st["error"] and st["figures"]["labs_cut"] == 2
    gc = _gpu_check()
    with pytest.raises(ValueError, match="no lab numbered"):
        gc.lab_names(["99"])
    assert len(gc.lab_names(None)) >= 16
