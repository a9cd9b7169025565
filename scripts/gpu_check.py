"""One stage of the GPU check (scripts/gpu_check.sh runs each stage in its own process, under its own timeout).

    python scripts/gpu_check.py --stage hf_match --device cuda --size full --out out/gpu

Stages write `<out>/<stage>.json` as soon as they end: {"stage", "status": passed|failed|skipped, "seconds",
"figures": {...}, "rows": [...], "error"}. The exit code is 0 for passed/skipped, 1 for failed.

It needs only what the lent machine has (torch, transformers, safetensors, tokenizers): random-weight models of
the course's shapes (SmolLM2-135M, Llama-3.2-1B), the tokenizer from the repo, no GGUF, no vLLM, no papermill.
`--size tiny` (with `--device cpu`) runs every stage at toy sizes, which is how CI tests this script.
`--forbid` makes importing the named packages fail, to prove a stage does not need them.
"""
from __future__ import annotations

import argparse
import importlib.abc
import json
import platform
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STAGES = ("env", "unit", "hf_match", "bandwidth", "throughput", "labs")
# per size: models for the greedy match, the bandwidth model, the throughput model and batches
SIZES = {
    "full": dict(match=["smollm2-135m-random", "llama-3.2-1b-random"], bound_model="llama-3.2-1b-random",
                 bound_models=["smollm2-135m-random", "llama-3.2-1b-random"], tput_model="smollm2-135m-random",
                 batches=[64, 128, 256], prompt_len=128, out_len=64, steps=20, match_tokens=24,
                 copy_bytes=1 << 30, kv_bytes=16 << 30),
    "tiny": dict(match=["tiny-random"], bound_model="tiny-random", bound_models=["tiny-random"],
                 tput_model="tiny-random", batches=[2, 4], prompt_len=16, out_len=6, steps=3, match_tokens=8,
                 copy_bytes=16 << 20, kv_bytes=64 << 20),
}
BOUND_GOAL = 0.6  # decode at batch 1 >= 60 % of the bandwidth bound (1B shape, CUDA graphs): a goal, not a test


class _Forbid(importlib.abc.MetaPathFinder):
    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"{fullname} is forbidden here (--forbid): the lent machine lacks it")
        return None


# ------------------------------------------------------------------------------------------------ stages
def stage_env(a, size) -> dict:
    import torch
    import transformers

    dev = _device(a.device)
    figs = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "device": str(dev), "cuda_available": torch.cuda.is_available()}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        figs.update(gpu=p.name, gpu_memory_GiB=round(p.total_memory / 2**30, 1), gpu_count=torch.cuda.device_count(),
                    capability=f"{p.major}.{p.minor}", bf16=torch.cuda.is_bf16_supported())
    return {"figures": figs}


def stage_unit(a, size) -> dict:
    """The CUDA-path unit tests (on CUDA the CUDA-marked ones run; on a CPU they skip)."""
    import subprocess

    tests = ["tests/unit/test_fast_paths.py", "tests/unit/test_cuda_logic.py", "tests/unit/test_engine_memory.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow", *tests]
    if a.size == "tiny":  # CI: the script's plumbing, not the tests again (CI runs them itself)
        cmd += ["-k", "kv_is_a_share"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
    if r.returncode:
        raise RuntimeError("unit tests failed: " + " | ".join(tail))
    return {"figures": {"pytest": tail[-1] if tail else ""}}


def stage_hf_match(a, size) -> dict:
    """Greedy tokens of the lab engine (its fast paths on) = Hugging Face transformers' on the same weights, fp32.
    A mismatch is accepted only where HF itself sees a near-tie between the two tokens."""
    import torch
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    from lab_utils import EngineConfig, LLMEngine, SamplingParams
    from lab_utils.models.loader import build_random, load_model
    from lab_utils.models.registry import lookup

    dev = _device(a.device)
    rows, failures = [], []
    for name in size["match"]:
        spec, _ = lookup(name)
        _, tok = load_model("tiny-random", device="cpu")  # the repo's tokenizer (SmolLM2's vocab)
        lab = build_random(spec.config).to(dev, torch.float32).eval()
        hf = HFLlama(LlamaConfig(**spec.config))
        hf.load_state_dict({k: v for k, v in lab.state_dict().items() if "rotary_emb" not in k}, strict=False)
        if hf.config.tie_word_embeddings:
            hf.tie_weights()
        hf = hf.to(dev, torch.float32).eval()
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 17, 40, 64)]
        n = size["match_tokens"]
        eng = LLMEngine((lab, tok), EngineConfig(max_num_seqs=4, kv_cache_memory_bytes=256 << 20), device=dev)
        eng.warmup(max_batch=4, max_context=64 + n)
        outs = eng.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        fast = {"graphs": eng.runner.graphs is not None, "attention": eng.runner.attention_backend,
                "fast_path_errors": dict(eng.runner.fast_path_errors)}
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
            gap = float(logits[ref[i]] - logits[o.token_ids[i]])
            if gap <= 1e-4 * float(logits.abs().max()) + 1e-5:
                ties += 1
            else:
                failures.append(f"{name}: prompt {len(p)} differs at token {i} (HF logit gap {gap:.2e})")
        rows.append({"model": name, "prompts": len(prompts), "equal": equal, "near_ties": ties, **fast})
        del lab, hf
        _free(dev)
    if failures:
        raise AssertionError("; ".join(failures))
    return {"rows": rows, "figures": {"models": len(rows)}}


def copy_bandwidth(dev, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), median of 5 after warm-up."""
    import torch

    from lab_utils.device import time_fn

    x = torch.empty(nbytes // 4, dtype=torch.float32, device=dev)
    y = torch.empty_like(x)
    t = time_fn(lambda: y.copy_(x), device=dev, warmup=2, repeat=5)
    del x, y
    return 2 * nbytes / t.median


def _decode_steps(eng, batch: int, prompt_len: int, steps: int) -> float:
    """Median seconds of a pure decode step with `batch` running requests (prefills done, warm-up excluded)."""
    from lab_utils import SamplingParams
    from lab_utils.device import synchronize

    rng = random.Random(0)
    for _ in range(batch):
        eng.add_request([rng.randrange(100, 40000) for _ in range(prompt_len)],
                        SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()
    for _ in range(2):
        eng.step()
    times = []
    for _ in range(steps):
        synchronize(eng.device)
        t0 = time.perf_counter()
        eng.step()
        synchronize(eng.device)
        times.append(time.perf_counter() - t0)
    while eng.has_unfinished():
        eng.step()
    return statistics.median(times)


def stage_bandwidth(a, size) -> dict:
    """Decode step at batch 1 against the bandwidth bound: (weight bytes + KV bytes read) / copy bandwidth."""
    import torch

    from lab_utils import EngineConfig, LLMEngine
    from lab_utils.device import resolve_dtype
    from lab_utils.engine.kv_budget import model_bytes
    from lab_utils.models.loader import load_model

    dev = _device(a.device)
    dtype = resolve_dtype(a.dtype, dev)
    bw = copy_bandwidth(dev, size["copy_bytes"])
    rows = []
    for name in size["bound_models"]:
        model, tok = load_model(name, device=dev, dtype=dtype)
        for eager in (False, True):
            eng = LLMEngine((model, tok), EngineConfig(max_num_seqs=1, enforce_eager=eager,
                                                       kv_cache_memory_bytes=size["kv_bytes"] // 16), device=dev)
            eng.warmup(max_batch=1, max_context=size["prompt_len"] + size["steps"] + 16)
            step = _decode_steps(eng, 1, size["prompt_len"], size["steps"])
            kv = (size["prompt_len"] + 8) * eng.bytes_per_token
            bound = (model_bytes(model) + kv) / bw
            rows.append({"model": name, "graphs": eng.runner.graphs is not None, "step_ms": step * 1e3,
                         "bound_ms": bound * 1e3, "achieved_over_bound": bound / step, "tokens_per_s": 1 / step,
                         "fast_path_errors": dict(eng.runner.fast_path_errors)})
            eng.close()
        del model
        _free(dev)
    best = max((r for r in rows if r["model"] == size["bound_model"]), key=lambda r: r["achieved_over_bound"])
    figs = {"copy_bandwidth_GBps": bw / 1e9, "dtype": str(dtype).replace("torch.", ""),
            "bound_model": size["bound_model"], "achieved_over_bound": best["achieved_over_bound"],
            "goal": BOUND_GOAL, "goal_met": best["achieved_over_bound"] >= BOUND_GOAL}
    return {"rows": rows, "figures": figs}


def stage_throughput(a, size) -> dict:
    """Output tokens/s of `batch` requests decoding together, with and without CUDA graphs."""
    from lab_utils import EngineConfig, LLMEngine
    from lab_utils.device import resolve_dtype
    from lab_utils.models.loader import load_model

    dev = _device(a.device)
    model, tok = load_model(size["tput_model"], device=dev, dtype=resolve_dtype(a.dtype, dev))
    rows = []
    for batch in size["batches"]:
        for eager in (False, True):
            eng = LLMEngine((model, tok), EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(512, batch * 2),
                                                       enforce_eager=eager, kv_cache_memory_bytes=size["kv_bytes"]),
                            device=dev)
            eng.warmup(max_batch=batch, max_context=size["prompt_len"] + size["steps"] + 16)
            step = _decode_steps(eng, batch, size["prompt_len"], size["steps"])
            rows.append({"model": size["tput_model"], "batch": batch, "graphs": eng.runner.graphs is not None,
                         "step_ms": step * 1e3, "output_tokens_per_s": batch / step,
                         "fast_path_errors": dict(eng.runner.fast_path_errors)})
            eng.close()
            _free(dev)
    speedups = {}
    for batch in size["batches"]:
        g = [r for r in rows if r["batch"] == batch]
        speedups[f"graphs_speedup_b{batch}"] = g[0]["output_tokens_per_s"] / g[1]["output_tokens_per_s"]
    return {"rows": rows, "figures": speedups}


# SMOKE runs whose claims hold with random weights of SmolLM2-135M's shape (timings, identities, the roofline):
# what the lent machine can run without the GGUF
RANDOM_WEIGHT_LABS = ("00_foundations",)


def stage_labs(a, size) -> dict:
    """The labs in SMOKE mode. With papermill and SmolLM2's GGUF: every lab (or `--labs`) through `run-labs`.
    Without them (the lent machine): the labs of RANDOM_WEIGHT_LABS with MODEL="smollm2-135m-random", executed
    by scripts/run_notebook.py (no Jupyter; plotly must be installed, e.g. from carried wheels)."""
    import importlib.util
    import subprocess

    if a.size == "tiny":
        return {"status": "skipped", "figures": {"reason": "tiny size (CI): CI executes the labs itself"}}

    def absent(m: str) -> bool:
        try:
            return importlib.util.find_spec(m) is None
        except ImportError:  # --forbid
            return True

    root = Path(__file__).resolve().parents[1]
    if not any(absent(m) for m in ("papermill", "nbformat", "gguf")):
        only = a.labs or []
        cmd = [sys.executable, "-m", "lab_utils", "run-labs", "--smoke", "--device", a.device, "--out",
               str(Path(a.out) / "labs"), *sum((["--only", x] for x in only), [])]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
        tail = (r.stdout + r.stderr).strip().splitlines()[-5:]
        if r.returncode:
            raise RuntimeError("labs failed: " + " | ".join(tail))
        return {"figures": {"labs": only or "all", "runner": "papermill", "summary": tail[-1] if tail else ""}}
    if absent("plotly"):
        raise RuntimeError("plotly is not installed: carry its wheels (pip download --no-deps --python-version 3.12 "
                           "plotly narwhals -d wheels/), gpu_check.sh installs wheels/*.whl")
    rows = []
    env = dict(__import__("os").environ, LAB_SMOKE="1", LAB_INTERACTIVE="0")
    for lab in RANDOM_WEIGHT_LABS:
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "scripts/run_notebook.py", f"labs/{lab}.ipynb", "-p", "SMOKE=True",
                            "-p", "INTERACTIVE=False", "-p", f"DEVICE={a.device!r}",
                            "-p", "MODEL='smollm2-135m-random'"], capture_output=True, text=True, cwd=root, env=env)
        (Path(a.out) / f"lab_{lab}.log").write_text(r.stdout + r.stderr)
        rows.append({"lab": lab, "passed": r.returncode == 0, "seconds": time.perf_counter() - t})
        if r.returncode:
            raise RuntimeError(f"lab {lab} failed: " + " | ".join((r.stdout + r.stderr).strip().splitlines()[-3:]))
    return {"rows": rows, "figures": {"runner": "scripts/run_notebook.py", "model": "smollm2-135m-random"}}


# ------------------------------------------------------------------------------------------------ plumbing
def _device(name: str):
    from lab_utils.device import resolve_device

    return resolve_device(name)


def _free(dev) -> None:
    import gc

    import torch

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def run_stage(a) -> int:
    size = SIZES[a.size]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rec = {"stage": a.stage, "device": a.device, "size": a.size, "status": "passed", "figures": {}, "rows": [],
           "error": None}
    try:
        if a.fail_stage == a.stage:  # CI's negative control: a failing stage must fail the script
            raise RuntimeError("failure injected with --fail-stage")
        rec.update(globals()[f"stage_{a.stage}"](a, size))
    except Exception as err:  # recorded, then reported through the exit code
        rec["status"] = "failed"
        rec["error"] = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    (out / f"{a.stage}.json").write_text(json.dumps(rec, indent=2, default=str))
    print(f"[{a.stage}] {rec['status']} in {rec['seconds']} s {rec['error'] or ''}")
    return 1 if rec["status"] == "failed" else 0


def table(out: Path) -> str:
    """One line per stage from the JSON files, for the end of gpu_check.sh."""
    lines = [f"{'stage':12s} {'status':8s} {'s':>7s}  figures"]
    for st in STAGES:
        f = out / f"{st}.json"
        if not f.exists():
            lines.append(f"{st:12s} {'missing':8s} {'':>7s}  (did not write its JSON: killed by its timeout?)")
            continue
        r = json.loads(f.read_text())
        figs = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["figures"].items())
        lines.append(f"{st:12s} {r['status']:8s} {r['seconds']:7.1f}  {r['error'] or figs}")
        for row in r.get("rows", []):
            lines.append(" " * 30 + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                              for k, v in row.items() if k != "fast_path_errors" or v))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", choices=STAGES)
    ap.add_argument("--table", action="store_true", help="print the table of the stages' JSON files and exit")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto", help="model dtype for timing stages (hf_match is always fp32)")
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--out", default="out/gpu")
    ap.add_argument("--labs", nargs="*", help="lab numbers for the labs stage (default: all)")
    ap.add_argument("--forbid", default="", help="comma-separated packages whose import must fail")
    ap.add_argument("--fail-stage", default="", help="make this stage fail (to test the script)")
    a = ap.parse_args(argv)
    if a.table:
        print(table(Path(a.out)))
        return 0
    if not a.stage:
        ap.error("--stage or --table is required")
    if a.forbid:
        sys.meta_path.insert(0, _Forbid({n.strip() for n in a.forbid.split(",") if n.strip()}))
    return run_stage(a)


if __name__ == "__main__":
    raise SystemExit(main())
