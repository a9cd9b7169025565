"""Lab 14's trace through real vLLM, without and with its KV offloading (`--kv-offloading-size`, the "native"
backend: `vllm/v1/kv_offload/`, an `OffloadingConnector` that keeps evicted blocks in CPU memory).

Each setting runs in a child process of its own (`python -m lab_utils.kvstore.vllm_offload job.json`): a vLLM
engine's memory goes back when the process ends, an engine that fails half-built leaves nothing behind, and
vLLM's in-process start-up never meets the modules a notebook or a test session has loaded. The same token-id
prompts run in the same order, one request at a time, greedy, at a device pool of about the lab engine's size
(in vLLM's blocks: its CPU attention needs a multiple of 32 tokens). A turn's hit is vLLM's own
`RequestOutput.num_cached_tokens` (blocks found on the device plus blocks loaded from the offload tier); its
TTFT is timed from `add_request` to the step that returns its first token.

vLLM 0.32's CPU build refuses offloading: `CPUOffloadingSpec.get_worker` accepts only CUDA-alike and XPU
platforms (the copies use CUDA streams and pinned host memory), so `compare` then reports `skipped` with
vLLM's own error and the flags for a GPU, next to what vLLM measured without offloading.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

BLOCK_SIZE_CPU = 32  # vLLM's CPU attention kernels need a multiple of 32 tokens per block
RESULT_TAG = "VLLM_OFFLOAD_RESULT "


def gpu_flags(model: str, device_tokens: int, offload_gib: float, block_size: int = 16) -> str:
    """The `vllm serve` command line for the same experiment on a GPU, where vLLM runs KV offloading: a device
    pool of `device_tokens` (plus vLLM's null block) and `offload_gib` GiB of CPU memory for evicted blocks."""
    blocks = -(-device_tokens // block_size) + 1
    return (f"vllm serve {model} --enable-prefix-caching --block-size {block_size} --num-gpu-blocks-override {blocks} "
            f"--max-model-len {(blocks - 1) * block_size} --kv-offloading-size {offload_gib:.4g} "
            f"--kv-offloading-backend native")


def compare(trace: Sequence, max_tokens: int, device_tokens: int, offload_bytes: int, model: str = "smollm2-135m",
            block_size: int | None = None, threads: int | None = None, timeout_s: float = 900.0) -> dict:
    """Run `trace` (lab 14's `TraceTurn`s, or plain token-id prompts) through vLLM with no offloading ("off")
    and with `offload_bytes` of CPU offload space ("offload"), at a device pool of `device_tokens` tokens.

    Returns {"vllm", "block_size", "num_gpu_blocks", "offload_gib", "gpu_flags", "settings": {name: summary}}
    (a summary: `hit_rate`, `returning_hit_rate`, `returning_ttft_ms`, per-turn `cached_tokens`, `ttft_ms`,
    `token_ids`, and vLLM's own prefix-cache counters), plus "skipped": <why> when vLLM is absent (no
    settings) or refuses offloading here ("off" only). Any other failure raises RuntimeError."""
    import importlib.util

    from lab_utils import vllm_env

    if os.environ.get("LAB_VLLM", "1") == "0":
        return {"skipped": "vLLM turned off here (LAB_VLLM=0)"}
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM is not installed here; install it with `make vllm`"}
    cpu = vllm_env.is_cpu()
    block_size = block_size or (BLOCK_SIZE_CPU if cpu else 16)
    # one block more than the pool: vLLM keeps a null block aside, and a request must fit what is left
    num_blocks = -(-device_tokens // block_size) + 1
    offload_gib = offload_bytes / (1 << 30)
    prompts = [list(getattr(t, "prompt", t)) for t in trace]
    turns = [getattr(t, "turn", 0) for t in trace]
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    out = {"vllm": None, "platform": "cpu" if cpu else "gpu", "block_size": block_size, "num_gpu_blocks": num_blocks,
           "offload_gib": offload_gib, "gpu_flags": gpu_flags(_folder_or_name(model), device_tokens, offload_gib),
           "settings": {}}
    for name, gib in (("off", None), ("offload", offload_gib)):
        job = {"model": model, "prompts": prompts, "max_tokens": max_tokens, "block_size": block_size,
               "num_blocks": num_blocks, "offload_gib": gib, "threads": threads}
        got = _run_child(job, timeout_s)
        if "absent" in got:
            return {"skipped": got["absent"]}
        out["vllm"] = got["vllm"]
        if "refused" in got:
            if name == "off":
                raise RuntimeError(f"vLLM did not start even without offloading: {got['refused']}")
            out["skipped"] = (f"{got['vllm']} refuses KV offloading on this platform ({out['platform']}): "
                              f"{got['refused']}. On a GPU: {out['gpu_flags']}")
            break
        out["settings"][name] = summarize(got, turns)
    return out


def summarize(got: dict, turns: Sequence[int]) -> dict:
    """Hit rates (cached / prompt tokens; all turns, and the returning ones: turn > 0) and the returning turns'
    median TTFT."""
    prompt, cached, ttft = got["prompt_tokens"], got["cached_tokens"], got["ttft_s"]
    back = [i for i, t in enumerate(turns) if t > 0]
    return {
        "hit_rate": sum(cached) / max(1, sum(prompt)),
        "returning_hit_rate": sum(cached[i] for i in back) / max(1, sum(prompt[i] for i in back)),
        "returning_ttft_ms": 1e3 * statistics.median(ttft[i] for i in back) if back else None,
        "cached_tokens": cached, "ttft_ms": [1e3 * s for s in ttft], "token_ids": got["token_ids"],
        "counters": got["counters"],
    }


def _folder_or_name(model: str) -> str:
    """The model's folder (as `vllm serve` takes it), without preparing it; its name where it has none."""
    from lab_utils.models.registry import lookup

    try:
        return str(lookup(model)[1] or model)
    except ValueError:
        return model


def _run_child(job: dict, timeout_s: float) -> dict:
    from lab_utils.paths import REPO_ROOT
    from lab_utils.vllm_env import env_defaults

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.json"
        path.write_text(json.dumps(job))
        env = {**env_defaults(job["threads"]), **os.environ, "OMP_NUM_THREADS": str(job["threads"]),
               "PYTHONPATH": str(REPO_ROOT)}
        proc = subprocess.run([sys.executable, "-m", "lab_utils.kvstore.vllm_offload", str(path)], cwd=REPO_ROOT,
                              env=env, check=False, capture_output=True, text=True, timeout=timeout_s)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    raise RuntimeError(f"the vLLM child exited {proc.returncode} without a result:\n{proc.stderr[-3000:]}")


# ------------------------------------------------------------------------------------------ in the child
def run_setting(job: dict) -> dict:
    """Build one vLLM engine and run the prompts one at a time. {"refused": "<error>"} when the engine does not
    build (offloading refused), {"absent": "<error>"} when vLLM does not import; otherwise per-turn prompt and
    cached tokens, TTFT and output ids."""
    from lab_utils import vllm_env

    vllm_env.setup(job["threads"])
    try:
        import vllm
        from vllm import LLM, SamplingParams
    except Exception as exc:  # noqa: BLE001 - absent or broken: the reason is the result
        return {"absent": f"vLLM cannot be imported here ({type(exc).__name__}: {exc}); install it with `make vllm`"}
    version = f"vllm {vllm.__version__}"

    from lab_utils.bench.backends_vllm import prometheus_dict
    from lab_utils.models.loader import model_folder

    folder = model_folder(job["model"])
    bs, n = job["block_size"], job["num_blocks"]
    extra = {}
    if job["offload_gib"]:
        extra = {"kv_offloading_size": job["offload_gib"], "kv_offloading_backend": "native"}
    if vllm_env.is_cpu():  # an explicit budget skips the CPU memory check that misreads a shared VM
        extra["kv_cache_memory_bytes"] = n * _bytes_per_block(folder, bs, 4)
    kw = vllm_env.llm_kwargs(max_num_seqs=1, block_size=bs, num_gpu_blocks=n, max_model_len=(n - 1) * bs,
                             max_num_batched_tokens=(n - 1) * bs, enable_prefix_caching=True, **extra)
    try:
        llm = LLM(model=str(folder), **kw)
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        return {"vllm": version, "refused": f"{type(exc).__name__}: {exc}"}
    eng = llm.llm_engine
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], params, use_tqdm=False)  # warm-up: under a block, not cached
    rows = {"vllm": version, "prompt_tokens": [], "cached_tokens": [], "ttft_s": [], "token_ids": []}
    for i, prompt in enumerate(job["prompts"]):
        t0 = time.perf_counter()
        eng.add_request(f"turn-{i}", {"prompt_token_ids": prompt}, params)
        first = final = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                if first is None and o.outputs and o.outputs[0].token_ids:
                    first = time.perf_counter() - t0
                if o.finished:
                    final = o
        rows["prompt_tokens"].append(len(prompt))
        rows["cached_tokens"].append(int(final.num_cached_tokens or 0))
        rows["ttft_s"].append(first)
        rows["token_ids"].append(list(final.outputs[0].token_ids))
    m = prometheus_dict(llm.get_metrics())
    rows["counters"] = {k.removeprefix("vllm:"): m[k] for k in sorted(m) if "prefix_cache" in k}
    return rows


def _bytes_per_block(folder: Path, block_size: int, dtype_bytes: int) -> int:
    c = json.loads((Path(folder) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes * block_size


if __name__ == "__main__":
    print(RESULT_TAG + json.dumps(run_setting(json.loads(Path(sys.argv[1]).read_text()))), flush=True)
