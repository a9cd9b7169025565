"""Engine configuration. Field names mirror vLLM's engine arguments so a flag means the same thing in both."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

SCHEDULERS = ("static", "continuous", "token_budget")
KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "bf16", "fp8", "int8")
QUANTIZATIONS = (None, "int8", "int4", "w8a8", "w8a8-g32")
PREEMPTION_MODES = ("recompute", "swap")
KV_LAYOUTS = ("paged", "contiguous")
KV_OFFLOAD_POLICIES = ("lru", "2q")  # host_tier.POLICIES
SPEC_METHODS = ("draft", "ngram", "medusa", "eagle")
# EngineConfig's CPU fast-path switches, and the environment variable that sets each one's default
CPU_SWITCH_ENV = {
    "cpu_kernels": "LAB_CPU_KERNELS",
    "cpu_packed_linear": "LAB_CPU_PACKED_LINEAR",
    "cpu_fused_layers": "LAB_CPU_FUSED_LAYERS",
    "cpu_small_m_linear": "LAB_CPU_SMALL_M_LINEAR",
}


def cpu_switch_default(name: str) -> bool:
    """The default of the CPU switch `name` (an `EngineConfig` field): on, unless its environment variable
    (`CPU_SWITCH_ENV`) is "0". The one place those variables are read: a config reads them when it is built, and
    the accelerations read them here when they are used without a config (a draft model, a benchmark)."""
    return os.environ.get(CPU_SWITCH_ENV[name], "1") != "0"


def attention_backend_names() -> tuple[str, ...]:
    """Every value `EngineConfig.attention_backend` accepts ("auto" and each backend's name)."""
    from lab_utils.engine.accel.attention_backends import backend_names

    return backend_names()


def _cpu_switch(name: str):
    return field(default_factory=functools.partial(cpu_switch_default, name))


@dataclass
class SpecConfig:
    """Speculative decoding: who proposes (`method`) and how many tokens per round (`num_speculative_tokens`)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None  # the draft model for method="draft", heads for medusa/eagle
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # method="draft": quantization of the draft ("int8" | "int4" weight-only; "w8a8" int8 weights and activations,
    # one activation scale per token; "w8a8-g32" one per 32 inputs; lm head included), in the role of vLLM's
    # speculative `quantization`. With model= the target's own name this is a self-draft: a quarter of the bytes
    # (int8, w8a8, w8a8-g32).
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"SpecConfig.method={self.method!r} is invalid: must be one of {SPEC_METHODS}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"SpecConfig.quantization={self.quantization!r} is invalid: must be one of "
                             f"{QUANTIZATIONS}")
        if self.quantization is not None and self.method != "draft":
            raise ValueError(f"SpecConfig.quantization applies to method='draft' only, not {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"SpecConfig.num_speculative_tokens={self.num_speculative_tokens} must be in [1, 16]")


@dataclass
class EngineConfig:
    max_num_seqs: int = 64  # concurrency: most requests running at once
    block_size: int = 16  # tokens per KV block
    num_gpu_blocks: int | None = None  # size of the KV pool; None: from the memory budget
    kv_cache_memory_bytes: int | None = None  # KV budget; None: 1 GiB on CPU, gpu_memory_utilization on CUDA
    # as vLLM: the share of the card's total memory for this engine's weights + activations + KV (kv_budget.py)
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 512  # token budget of one step
    max_model_len: int | None = None  # None: the model's context length
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    speculative: SpecConfig | None = None
    scheduler: str = "token_budget"
    preemption_mode: str = "recompute"
    kv_layout: str = "paged"  # "contiguous": reserve max_model_len per sequence up front (the pre-vLLM way)
    watermark: float = 0.01  # share of blocks kept free when admitting, so running requests can grow
    # host memory for the prefix cache's evicted blocks (vLLM's --kv-offloading-size, in bytes; host_tier.py):
    # a returning prefix is copied back instead of recomputed. None or 0: off, an evicted block is gone
    kv_offload_bytes: int | None = None
    kv_offload_policy: str = "lru"  # which host-tier entry goes first: "lru", or "2q" (keeps returning prefixes)
    # disk under the host tier (vLLM's "fs" secondary tier; disk_tier.py), in bytes: the host tier's dropped
    # entries go there, in one file inside a directory made under kv_offload_disk_path (None: the system's temp
    # dir) and removed when the engine closes. None or 0: off. Needs the host tier (kv_offload_bytes)
    kv_offload_disk_bytes: int | None = None
    kv_offload_disk_path: str | None = None
    # read a new request's disk-tier blocks into the host tier on a background thread as it is added, so that
    # they are host hits by its admission (off: they are read when its prefix is looked up)
    kv_offload_prefetch: bool = True
    enforce_eager: bool = False
    # which attention computes a step: "auto" (flex on CUDA where it can compile, else sdpa) or a backend's name
    # (`attention_backends.ATTENTION_BACKENDS`, the one list; `attention_backend_names()`); a named backend that
    # cannot run on the device and dtype the engine gets is refused when the engine is built, never swapped
    attention_backend: str = "auto"
    seed: int = 0
    # CPU fast paths (lab_utils.engine.accel): PyTorch's results to float32 round-off, on by default, off for A/B
    # measurements; `enforce_eager` leaves them on (kernels, not compilation). The environment sets the defaults:
    # LAB_CPU_KERNELS=0 etc. (CPU_SWITCH_ENV, read when the config is built)
    cpu_kernels: bool = _cpu_switch("cpu_kernels")  # compiled C++ kernels; off: PyTorch's ops (vLLM: custom_ops none)
    cpu_packed_linear: bool = _cpu_switch("cpu_packed_linear")  # linears packed once for oneDNN; off: F.linear, unfused
    cpu_fused_layers: bool = _cpu_switch("cpu_fused_layers")  # Llama's q/k/v and gate/up as one packed linear each
    cpu_small_m_linear: bool = _cpu_switch("cpu_small_m_linear")  # few-row linears on the compiled small-M GEMM

    def __post_init__(self) -> None:
        def need(name: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)!r} is invalid: must be {allowed}")

        need("max_num_seqs", isinstance(self.max_num_seqs, int) and 1 <= self.max_num_seqs <= 4096, "an int in [1, 4096]")
        need("block_size", self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "a power of two in [1, 256]")
        need("num_gpu_blocks", self.num_gpu_blocks is None or self.num_gpu_blocks >= 1, "None or >= 1")
        need("kv_cache_memory_bytes", self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "None or > 0")
        need("gpu_memory_utilization", 0.0 < self.gpu_memory_utilization <= 1.0, "in (0, 1]")
        need("max_num_batched_tokens", isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1, "an int >= 1")
        need("max_model_len", self.max_model_len is None or self.max_model_len >= 1, "None or >= 1")
        need("kv_cache_dtype", self.kv_cache_dtype in KV_CACHE_DTYPES, f"one of {KV_CACHE_DTYPES}")
        need("quantization", self.quantization in QUANTIZATIONS, f"one of {QUANTIZATIONS}")
        need("scheduler", self.scheduler in SCHEDULERS, f"one of {SCHEDULERS}")
        need("preemption_mode", self.preemption_mode in PREEMPTION_MODES, f"one of {PREEMPTION_MODES}")
        need("kv_layout", self.kv_layout in KV_LAYOUTS, f"one of {KV_LAYOUTS}")
        need("watermark", 0.0 <= self.watermark < 0.5, "in [0, 0.5)")
        need("kv_offload_bytes", self.kv_offload_bytes is None or (isinstance(self.kv_offload_bytes, int)
                                                                    and self.kv_offload_bytes >= 0),
             "None (off) or an int >= 0 (bytes of host memory; 0: off)")
        need("kv_offload_policy", self.kv_offload_policy in KV_OFFLOAD_POLICIES, f"one of {KV_OFFLOAD_POLICIES}")
        need("kv_offload_disk_bytes", self.kv_offload_disk_bytes is None or (
            isinstance(self.kv_offload_disk_bytes, int) and self.kv_offload_disk_bytes >= 0),
             "None (off) or an int >= 0 (bytes of disk; 0: off)")
        need("kv_offload_prefetch", isinstance(self.kv_offload_prefetch, bool), "True or False")
        if self.attention_backend != "auto":  # (the names live with the backends: imported only when one is named)
            need("attention_backend", self.attention_backend in attention_backend_names(),
                 f"one of {attention_backend_names()}")
        if self.kv_offload_disk_bytes and not self.kv_offload_bytes:
            raise ValueError(f"EngineConfig.kv_offload_disk_bytes={self.kv_offload_disk_bytes} keeps the blocks the "
                             f"host tier drops, but the host tier is off (kv_offload_bytes="
                             f"{self.kv_offload_bytes}); give it some host memory too")
        if self.kv_offload_bytes and (not self.enable_prefix_caching or self.kv_layout == "contiguous"):
            raise ValueError(f"EngineConfig.kv_offload_bytes={self.kv_offload_bytes} keeps the prefix cache's "
                             f"evicted blocks, but the prefix cache is off (enable_prefix_caching="
                             f"{self.enable_prefix_caching}, kv_layout={self.kv_layout!r}); turn it on or set "
                             f"kv_offload_bytes=None")
        for name in CPU_SWITCH_ENV:
            need(name, isinstance(getattr(self, name), bool), "True or False")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"EngineConfig.max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"block_size={self.block_size}; raise the budget to at least one block"
            )
        if isinstance(self.speculative, dict):
            self.speculative = SpecConfig(**self.speculative)

    def check_against_model(self, max_model_len: int) -> None:
        """Checks that need the model's context length (called by the engine once it is known)."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"with enable_chunked_prefill=False a whole prompt must fit in one step, but "
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_model_len={max_model_len}; "
                f"raise max_num_batched_tokens to >= {max_model_len}, lower max_model_len, or enable chunked prefill"
            )
