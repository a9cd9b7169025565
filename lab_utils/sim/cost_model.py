"""A roofline for one engine step: FLOPs and bytes from the batch's shape, time from datasheet peaks.

For a step computing `n` new tokens of each sequence, whose KV already holds `start` tokens:
- FLOPs  = 2 · (layer params) · T  +  2 · hidden · vocab · S  +  attention 4 · heads · head_dim · Σ causal pairs
           (T tokens in the step, S sequences sampled: the LM head runs only on each sequence's last row)
- bytes  = weights (read once per step, whatever the batch)  +  KV read (the context) and written (the new tokens)
- time   = max(FLOPs / peak, bytes / bandwidth)  +  communication  +  per-step overhead
Decode (T small) is bound by bytes: the weights are read to make one token per sequence. Prefill (T large) is
bound by FLOPs. Tensor parallelism over n devices divides both and adds two all-reduces of the activations per
layer; pipeline parallelism splits the layers into stages and pays a bubble while the pipeline fills.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lab_utils.sim.gpus import Hardware

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-family decoder: all the cost model needs."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool = False
    dtype_bytes: int = 2
    kv_dtype_bytes: int | None = None  # None: same as the weights

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        head = 0 if self.tied_embeddings else self.embed_params
        return self.num_layers * self.layer_params + self.embed_params + head + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer: 2 · layers · kv_heads · head_dim · bytes (the engine's count, `paging.py`; one
        byte a value is FP8, which has no scales)."""
        import torch

        from lab_utils.engine.kv.paging import bytes_per_token

        store = {4: torch.float32, 2: torch.float16, 1: torch.float8_e4m3fn}[self.kv_dtype_bytes or self.dtype_bytes]
        return bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, store)

    @classmethod
    def from_config(cls, name: str, cfg, dtype_bytes: int = 2) -> ModelSpec:
        """From a Hugging Face / lab `LlamaConfig`-like object."""
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(name, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                   getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, head_dim,
                   cfg.intermediate_size, cfg.vocab_size, bool(getattr(cfg, "tie_word_embeddings", False)), dtype_bytes)


# Shapes from each model's config.json on the Hugging Face hub (HuggingFaceTB/SmolLM2-135M-Instruct,
# meta-llama/Meta-Llama-3-8B, meta-llama/Meta-Llama-3-70B, meta-llama/Llama-3.2-1B).
MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, True, dtype_bytes=4),  # fp32 in the lab
    "llama-3.2-1b": ModelSpec("llama-3.2-1b", 16, 2048, 32, 8, 64, 8192, 128256, True),
    "llama-3-8b": ModelSpec("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, False),
    "llama-3-70b": ModelSpec("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, False),
}


def _random_weight_spec(name: str) -> ModelSpec | None:
    """A random-weight model of the course (`smollm2-135m-random`, ...) costs what its shape costs: the same
    bytes and FLOPs per step as the trained model of that shape (bytes per value from it, else fp32 as the lab)."""
    from types import SimpleNamespace

    from lab_utils.models.registry import REGISTRY

    reg = REGISTRY.get(name)
    if reg is None or reg.kind != "random" or reg.config is None:
        return None
    base = MODELS.get(name.removesuffix("-random"))
    return ModelSpec.from_config(name, SimpleNamespace(**reg.config), base.dtype_bytes if base else 4)


def model_spec(name: str, dtype: str | None = None) -> ModelSpec:
    """A named model's shape; `dtype` ("fp16", "fp8", ...) overrides the weights' (and KV's) bytes per value.
    Random-weight names of the model registry (`smollm2-135m-random`) give their shape."""
    spec = MODELS.get(name) or _random_weight_spec(name)
    if spec is None:
        from lab_utils.models.registry import REGISTRY

        randoms = sorted(n for n, r in REGISTRY.items() if r.kind == "random")
        raise ValueError(f"unknown model {name!r}: choose one of {sorted(MODELS) + randoms} or build a ModelSpec(...)")
    if dtype is not None:
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={dtype!r} is invalid: must be one of {sorted(DTYPE_BYTES)}")
        from dataclasses import replace
        spec = replace(spec, dtype_bytes=DTYPE_BYTES[dtype], kv_dtype_bytes=None)
    return spec


# ------------------------------------------------------------------------------------------------- pieces
def allreduce_time(num_bytes: float, n: int, link_bw: float, latency_s: float = 0.0) -> float:
    """Ring all-reduce of `num_bytes` over `n` devices: each sends and receives 2·(n−1)/n of the data
    (reduce-scatter then all-gather), at `link_bw` bytes/s per direction, plus one latency per collective."""
    if n < 1:
        raise ValueError(f"n={n} devices is invalid: must be >= 1")
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n * num_bytes / link_bw + latency_s


def causal_pairs(start: int, n: int) -> int:
    """(query, key) pairs when `n` new tokens attend to `start` cached tokens and, causally, to each other."""
    return n * start + n * (n + 1) // 2


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float
    bubble_s: float
    time_s: float

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved: compare with `Hardware.ridge_flops_per_byte`."""
        return self.flops / self.bytes if self.bytes else math.inf


def _work(model: ModelSpec, batch: Sequence[tuple[int, int]], num_sampled: int) -> tuple[float, float, float, float, int]:
    """(layer FLOPs, head FLOPs, layer bytes, head bytes, tokens) of one step on one device, no parallelism."""
    T = sum(n for _, n in batch)
    pairs = sum(causal_pairs(s, n) for s, n in batch)
    ctx = sum(s + n for s, n in batch)  # KV read (old context) + written (new tokens)
    L, h = model.num_layers, model.hidden_size
    f_layers = 2 * L * model.layer_params * T + 4 * L * model.num_heads * model.head_dim * pairs
    f_head = 2 * h * model.vocab_size * num_sampled
    b_layers = L * model.layer_params * model.dtype_bytes + ctx * model.kv_bytes_per_token
    b_head = model.embed_params * model.dtype_bytes + T * h * model.dtype_bytes  # LM head weights + embedding rows
    return f_layers, f_head, b_layers, b_head, T


def step_cost(model: ModelSpec, hw: Hardware, batch: Sequence[tuple[int, int]], num_sampled: int | None = None,
              tp: int = 1, pp: int = 1, microbatches: int | None = None) -> StepCost:
    """Time of one engine step. `batch`: (tokens already in the KV, new tokens) per scheduled sequence;
    `num_sampled`: sequences that produce a token this step (default: all). `tp`/`pp`: tensor and pipeline
    parallel degrees; with pp > 1 the batch is cut into `microbatches` (default pp) that fill the pipeline."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tp={tp}, pp={pp} are invalid: both must be >= 1")
    if pp > model.num_layers:
        raise ValueError(f"pp={pp} is invalid: the model has only {model.num_layers} layers to split")
    batch = [(int(s), int(n)) for s, n in batch]
    if not batch:
        return StepCost(0, 0, 0, 0, 0, 0, 0, 0)
    S = len(batch) if num_sampled is None else num_sampled
    overhead = hw.step_overhead_s + hw.seq_overhead_s * len(batch)
    m = 1 if pp == 1 else max(1, min(microbatches or pp, len(batch)))
    # the slowest stage: 1/pp of the layers plus the LM head (last stage), one micro-batch (1/m of the sequences)
    f_l, f_h, _, _, T = _work(model, batch, S)
    kv_share = max(1 / tp, 1 / model.num_kv_heads)  # KV heads are replicated once tp exceeds them
    ctx = sum(s + n for s, n in batch)
    w_layers = model.num_layers * model.layer_params * model.dtype_bytes
    w_head = model.embed_params * model.dtype_bytes
    flops = (f_l / pp + f_h) / tp / m
    byts = (w_layers / pp + w_head) / tp + ctx * model.kv_bytes_per_token * kv_share / pp / m \
        + T / m * model.hidden_size * model.dtype_bytes
    compute_s, memory_s = flops / hw.peak_flops, byts / hw.mem_bw
    act = T / m * model.hidden_size * model.dtype_bytes  # one micro-batch's activations
    comm = 2 * (model.num_layers / pp) * allreduce_time(act, tp, hw.link_bw, hw.link_latency_s)
    stage = max(compute_s, memory_s) + comm
    p2p = (act / hw.link_bw + hw.link_latency_s) if pp > 1 else 0.0
    slots = m + pp - 1  # pipeline fill + drain: (pp-1) idle slots, the bubble
    total = slots * (stage + p2p) + overhead
    return StepCost(flops=(f_l + f_h), bytes=byts * slots, compute_s=compute_s * m, memory_s=memory_s * m,
                    comm_s=(comm + p2p) * slots, overhead_s=overhead, bubble_s=(pp - 1) * (stage + p2p), time_s=total)


def kv_capacity(model: ModelSpec, hw: Hardware, num_gpus: int = 1, gpu_memory_utilization: float = 0.9,
                reserve_bytes: float = 0.0, tp: int | None = None) -> dict:
    """KV tokens that fit when the model is sharded over `num_gpus` (`tp` of them in tensor parallel, all by
    default; the rest pipeline stages): weights are paid once in total (1/n per device), and everything else the
    devices hold becomes KV. Same formula as vLLM's sizing: free = n · (memory · utilization − reserve) − weights,
    over the bytes per token, times the KV heads' replication when TP exceeds them
    (`lab_utils.parallel.kv_heads`)."""
    from lab_utils.parallel.kv_heads import kv_replication

    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} is invalid: must be in (0, 1]")
    if num_gpus < 1:
        raise ValueError(f"num_gpus={num_gpus} is invalid: must be >= 1")
    replication = kv_replication(model.num_kv_heads, num_gpus if tp is None else tp)
    usable = num_gpus * (hw.mem_bytes * gpu_memory_utilization - reserve_bytes)
    free = usable - model.weight_bytes
    per_token = model.kv_bytes_per_token if replication == 1 else model.kv_bytes_per_token * replication
    tokens = max(0, int(free // per_token))
    return {"fits": free > 0, "weight_bytes": model.weight_bytes, "usable_bytes": usable, "kv_bytes": max(free, 0.0),
            "kv_tokens": tokens, "kv_bytes_per_token": model.kv_bytes_per_token, "kv_replication": replication}


def max_concurrent_seqs(model: ModelSpec, hw: Hardware, seq_len: int, num_gpus: int = 1, block_size: int = 16,
                        **kw) -> int:
    """Sequences of `seq_len` tokens whose KV fits at once (paged: each rounds up to whole blocks)."""
    cap = kv_capacity(model, hw, num_gpus, **kw)
    per_seq = -(-seq_len // block_size) * block_size
    return cap["kv_tokens"] // per_seq
