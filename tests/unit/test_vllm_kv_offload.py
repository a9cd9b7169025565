"""vLLM's KV offloading beside lab 14's host tier (`lab_utils.kvstore.vllm_offload`).

The fast tests check the bookkeeping with vLLM's child process stubbed. The `slow` one runs real vLLM (in child
processes, so it may share a pytest process with the other tests): where vLLM runs offloading, returning turns
hit more with it than without; where it refuses (its CPU build), the result says skipped with vLLM's error and
still carries what vLLM measured without offloading. Without vLLM it skips.
"""
from __future__ import annotations

import importlib.util
import random

import pytest

from lab_utils.kvstore import vllm_offload
from lab_utils.kvstore.returning import TraceTurn


def small_trace(seed: int = 0) -> list[TraceTurn]:
    """Three conversations of two turns, round-robin, behind one shared system prompt: ~270-token prompts."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(100, 40000) for _ in range(n)]
    system = ids(40)
    history = {c: system + ids(150) for c in "abc"}
    trace = []
    for turn in range(2):
        for c in "abc":
            history[c] = history[c] + ids(40)
            trace.append(TraceTurn(c, turn, tuple(history[c])))
    return trace


def fake_child(refuse_offload: bool = True, refuse_off: bool = False):
    def run(job, timeout_s):
        if (job["offload_gib"] and refuse_offload) or (not job["offload_gib"] and refuse_off):
            return {"vllm": "vllm 9.9", "refused": "Exception: CPU Offloading is currently only supported on GPUs"}
        n = len(job["prompts"])
        cached = [0, 0, 0, 192, 192, 192] if job["offload_gib"] else [0, 0, 0, 32, 32, 32]
        return {"vllm": "vllm 9.9", "prompt_tokens": [len(p) for p in job["prompts"]], "cached_tokens": cached[:n],
                "ttft_s": [0.1] * n, "token_ids": [[1]] * n, "counters": {}}
    return run


@pytest.fixture
def vllm_installed(monkeypatch):
    monkeypatch.delenv("LAB_VLLM", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))


def test_refusal_is_reported_as_skipped_with_the_reason(monkeypatch, vllm_installed):
    monkeypatch.setattr(vllm_offload, "_run_child", fake_child(refuse_offload=True))
    r = vllm_offload.compare(small_trace(), 4, 352, 64 << 20, threads=1)
    assert "CPU Offloading is currently only supported" in r["skipped"] and "vllm 9.9" in r["skipped"]
    assert "--kv-offloading-size" in r["skipped"] and set(r["settings"]) == {"off"}


def test_both_settings_summarized(monkeypatch, vllm_installed):
    monkeypatch.setattr(vllm_offload, "_run_child", fake_child(refuse_offload=False))
    r = vllm_offload.compare(small_trace(), 4, 352, 64 << 20, threads=1)
    assert "skipped" not in r and set(r["settings"]) == {"off", "offload"}
    off, on = r["settings"]["off"], r["settings"]["offload"]
    n = sum(len(t.prompt) for t in small_trace()[3:])
    assert off["returning_hit_rate"] == pytest.approx(96 / n) and on["returning_hit_rate"] == pytest.approx(576 / n)
    assert on["returning_ttft_ms"] == pytest.approx(100.0)


def test_vllm_that_does_not_start_raises(monkeypatch, vllm_installed):
    monkeypatch.setattr(vllm_offload, "_run_child", fake_child(refuse_off=True))
    with pytest.raises(RuntimeError, match="even without offloading"):
        vllm_offload.compare(small_trace(), 4, 352, 64 << 20, threads=1)


def test_turned_off_or_absent_skips_without_a_child(monkeypatch):
    monkeypatch.setattr(vllm_offload, "_run_child", lambda *a: pytest.fail("no child expected"))
    monkeypatch.setenv("LAB_VLLM", "0")
    assert "LAB_VLLM=0" in vllm_offload.compare(small_trace(), 4, 352, 1 << 20)["skipped"]
    monkeypatch.delenv("LAB_VLLM")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert "not installed" in vllm_offload.compare(small_trace(), 4, 352, 1 << 20)["skipped"]


def test_gpu_flags_size_the_pool_in_blocks():
    flags = vllm_offload.gpu_flags("/m", 352, 0.5)
    assert "--num-gpu-blocks-override 23 " in flags and "--max-model-len 352 " in flags  # 22 blocks + the null block
    assert "--kv-offloading-size 0.5 " in flags and flags.endswith("--kv-offloading-backend native")


# ------------------------------------------------------------------------------------------ real vLLM
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_offloading_beside_no_offloading():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here")
    trace = small_trace()
    r = vllm_offload.compare(trace, 4, 352, 64 << 20, threads=1)
    if "settings" not in r:
        pytest.skip(r["skipped"])  # vLLM absent or broken: the reason
    off = r["settings"]["off"]
    assert all(len(t) == 4 for t in off["token_ids"]) and 0 <= off["returning_hit_rate"] < 1
    assert off["cached_tokens"][0] == 0
    if "skipped" in r:  # refused offloading (only its CPU build may): vLLM's own error, no offload figures
        assert r["platform"] == "cpu", r["skipped"]
        assert "offload" not in r["settings"] and "refuses KV offloading" in r["skipped"]
        assert "--kv-offloading-size" in r["skipped"]
        return
    on = r["settings"]["offload"]
    assert on["returning_hit_rate"] > off["returning_hit_rate"], (off["cached_tokens"], on["cached_tokens"])
