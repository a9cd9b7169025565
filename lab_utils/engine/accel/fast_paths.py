"""Which fast path a step takes, and what happens when one fails on this machine.

A runner has up to three fast paths, each chosen once when the engine is built (`for_engine`):
- "cuda_graphs": decode-only steps replayed as CUDA graphs (`cuda_graphs.DecodeGraphRunner`; CUDA, not
  `enforce_eager`);
- "flex": the "flex" attention backend (`attention_backends`; CUDA, not `enforce_eager`);
- "cpu_kernel": decode-like rows through the compiled CPU kernel (a float32 cache on a CPU, `cpu_kernels` on).
A fast path can fail where its compiler or driver misbehaves. Then that one is turned off (the others stay on), a
warning says which and why, and the step runs again; re-running is safe, K/V writes are idempotent (same values,
same slots).
"""
from __future__ import annotations

import warnings
from typing import Callable, TypeVar

import torch

from lab_utils.engine.accel.attention_backends import step_attention
from lab_utils.engine.accel.cpu_attention import MAX_KERNEL_QUERIES, kernel_usable
from lab_utils.engine.accel.cuda_graphs import runner_options
from lab_utils.engine.kv.kv_cache import KVCache
from lab_utils.models.llama import AttentionFn

T = TypeVar("T")

# the fast paths one failure can turn off, each on its own, and how a user turns it off up front
FAST_PATHS = {
    "cuda_graphs": "enforce_eager=True skips CUDA graphs and flex",
    "flex": "enforce_eager=True skips flex and CUDA graphs",
    "cpu_kernel": "cpu_kernels=False (LAB_CPU_KERNELS=0) skips the CPU kernels",
}


class FastPaths:
    """The fast paths one runner takes, and the ones turned off so far."""

    def __init__(self, attention_backend: str = "sdpa", graphs=None, cpu_kernel: bool = False) -> None:
        self.attention_backend = attention_backend  # "sdpa" | "flex" (attention_backends.ATTENTION_BACKENDS)
        self.graphs = graphs  # a cuda_graphs.DecodeGraphRunner, or None
        self.cpu_kernel = cpu_kernel  # "sdpa" steps try the compiled CPU kernel first
        self.error: str | None = None  # the last fast path that failed, and why (the runner fell back)
        self.errors: dict[str, str] = {}  # every fast path turned off so far -> why

    @classmethod
    def for_engine(cls, config, device: torch.device, model: torch.nn.Module, cache: KVCache, block_size: int,
                   max_model_len: int) -> FastPaths:
        """An engine's fast paths: flex attention and decode CUDA graphs on CUDA (none with enforce_eager), the
        CPU kernel for a float32 cache on a CPU (`config.cpu_kernels`)."""
        options = runner_options(config, device, model, cache, block_size, max_model_len)
        cpu = options["attention_backend"] == "sdpa" and kernel_usable(cache, device, config.cpu_kernels)
        return cls(**options, cpu_kernel=cpu)

    @classmethod
    def plain(cls, cache: KVCache, device: torch.device) -> FastPaths:
        """SDPA without graphs, and the CPU kernel where it can run (`EngineConfig`'s default switch)."""
        return cls("sdpa", None, kernel_usable(cache, device))

    def turn_all_off(self) -> None:
        """Plain SDPA only (a learner's slot mapping runs through the reference `PagedAttention`)."""
        self.attention_backend, self.graphs, self.cpu_kernel = "sdpa", None, False

    def graphs_take(self, q_lens: list[int], n: int) -> bool:
        """Whether a step of `n` rows replays a CUDA graph: decode-only, and a graph bucket holds it."""
        return self.graphs is not None and max(q_lens) == 1 and self.graphs.can_run(n)

    def replay_decode(self, ids: list[int], pos: list[int], ctx_lens: list[int], q_lens: list[int],
                      tables: list[list[int]]) -> torch.Tensor | None:
        """The step's hidden states [n, H] from a CUDA graph, or None where no graph takes the step."""
        if not self.graphs_take(q_lens, len(ids)):
            return None
        return self.graphs.run(ids, pos, ctx_lens, tables)

    def attention(self, cache: KVCache, tables: list[list[int]], ctx_lens: list[int], q_lens: list[int],
                  block_size: int, device: torch.device) -> AttentionFn:
        """The step's attention callable, from the attention backend (`attention_backends`)."""
        off = () if self.cpu_kernel else ("cpu_kernel",)
        return step_attention(self.attention_backend, cache, tables, ctx_lens, q_lens, block_size, device, off)

    def chosen(self, q_lens: list[int], n: int) -> str | None:
        """Which fast path a step of `n` rows takes (the one to blame if it fails), None for the plain eager path."""
        if self.graphs_take(q_lens, n):
            return "cuda_graphs"
        if self.attention_backend == "flex":
            return "flex"
        if self.attention_backend == "sdpa" and self.cpu_kernel and min(q_lens) <= MAX_KERNEL_QUERIES:
            return "cpu_kernel"
        return None

    def run(self, forward: Callable[[], T], q_lens: list[int], n: int) -> T:
        """`forward()` of a step of `n` rows; where the fast path it takes fails, again without that one."""
        for _ in range(len(FAST_PATHS) + 1):  # each fast path can fail (and be turned off) once
            path = self.chosen(q_lens, n)
            try:
                return forward()
            except Exception as err:
                if path is None:
                    raise
                self.turn_off(path, err)
        raise AssertionError("unreachable: every fast path is off after one failure each")

    def turn_off(self, path: str, err: Exception) -> None:
        """`path` failed on this machine: turn off that one only (the others keep running), say which and why."""
        why = short_error(err)
        self.error = f"{path}: {why}"
        self.errors[path] = why
        if path == "cuda_graphs":
            self.graphs = None
        elif path == "flex":
            self.attention_backend = "sdpa"
            self.cpu_kernel = False  # the CPU kernel was never chosen for this engine: keep it that way
        else:
            self.cpu_kernel = False
        on = [p for p, active in (("cuda_graphs", self.graphs is not None), ("flex", self.attention_backend == "flex"),
                                  ("cpu_kernel", self.cpu_kernel)) if active]
        warnings.warn(f"fast path {path!r} failed ({why}); falling back to eager for it alone"
                      f" (still on: {', '.join(on) or 'none'}). {FAST_PATHS[path]}")


def short_error(err: Exception, limit: int = 500) -> str:
    """An exception as one readable line: compiler errors carry pages of build output."""
    text = f"{type(err).__name__}: {err}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines[1:] if "error" in ln.lower()]
    text = " | ".join(lines[:1] + errors[:2])
    return text if len(text) <= limit else text[:limit] + " ..."
