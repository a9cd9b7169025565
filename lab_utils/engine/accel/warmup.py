"""Warm-up: compile (flex) and capture (CUDA graphs) the shapes a run will use before it is measured, as vLLM does
at start-up. Without it the first step of each new batch size pays a capture (and the first steps a compilation)
inside the measurement."""
from __future__ import annotations

import time
from typing import Callable

import torch

from lab_utils.engine.accel.cuda_graphs import MIN_CONTEXT_BUCKET, bucket_for, context_bucket
from lab_utils.engine.accel.fast_paths import FastPaths

# (token ids, positions, context lengths, query lengths, block tables) -> hidden states: the runner's forward
Step = Callable[[list[int], list[int], list[int], list[int], list[list[int]]], torch.Tensor]


def warmup_shapes(fast_paths: FastPaths, max_batch: int, max_context: int | None, block_size: int,
                  max_model_len: int) -> tuple[list[int], list[int]]:
    """(batch sizes, context lengths) to warm up: every graph batch bucket up to `max_batch` (batch 1 alone
    without graphs) at every context bucket up to `max_context` (None: the first bucket)."""
    graphs = fast_paths.graphs
    batches = [1]
    if graphs is not None:
        top = bucket_for(max_batch, graphs.buckets) or graphs.buckets[-1]
        batches = [b for b in graphs.buckets if b <= top]
    longest = min(max_context or 1, max_model_len)
    steps = [MIN_CONTEXT_BUCKET]
    while steps[-1] < longest:
        steps.append(steps[-1] * 2)
    contexts = sorted({context_bucket(min(c, longest), block_size, max_model_len) for c in steps})
    return batches, contexts


@torch.inference_mode()
def warm_up(fast_paths: FastPaths, step: Step, block_size: int, device: torch.device, batch_sizes: list[int],
            context_lens: list[int], prefill_len: int, num_blocks: int) -> dict:
    """Run dummy steps through `step`: prefill and decode forwards at batch 1 and batch > 1 (flex compiles one
    kernel per such shape class), and one CUDA graph per (batch bucket, context bucket) in `batch_sizes` x
    `context_lens`.

    The dummy steps write K/V into blocks 0.. of the pool: call it only while no block is in use or cached
    (`LLMEngine.warmup` checks). Returns what it did."""
    from lab_utils.device import synchronize

    t0 = time.perf_counter()

    def table(L: int) -> list[int]:
        return list(range(-(-L // block_size)))

    graphs = fast_paths.graphs
    steps, before = 0, len(graphs.entries) if graphs is not None else 0
    n = min(prefill_len, num_blocks * block_size)
    for b in (1, 2):  # prefill shapes (Q > 1), then eager decode shapes (Q = 1)
        for q in (n, 1):
            step([0] * (q * b), list(range(q)) * b, [q] * b, [q] * b, [table(q)] * b)
            steps += 1
    for L in sorted(set(context_lens)):
        if fast_paths.graphs is None or -(-L // block_size) > num_blocks:
            break
        for b in sorted(set(batch_sizes)):
            if not fast_paths.graphs.can_run(b):
                break
            step([0] * b, [L - 1] * b, [L] * b, [1] * b, [table(L)] * b)
            steps += 1
    synchronize(device)
    captured = len(fast_paths.graphs.entries) - before if fast_paths.graphs is not None else 0
    return {"steps": steps, "graphs": captured, "seconds": time.perf_counter() - t0,
            "fast_path_errors": dict(fast_paths.errors)}
