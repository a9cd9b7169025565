"""Turns a scheduled step into one forward pass: flat token ids + positions + attention metadata -> logits
for the requests whose next token is due."""
from __future__ import annotations

import time
import warnings

import torch

from lab_utils.engine.attention import AttentionMetadata, PagedAttention
from lab_utils.engine.accel import (
    MAX_KERNEL_QUERIES,
    CpuDecodeAttention,
    SplitMetadata,
    SplitPagedAttention,
    kernel_usable,
)
from lab_utils.engine.kv_cache import KVCache
from lab_utils.engine.request import Request


# the fast paths one failure can turn off, each on its own, and how a user turns it off up front
FAST_PATHS = {
    "cuda_graphs": "enforce_eager=True skips CUDA graphs and flex",
    "flex": "enforce_eager=True skips flex and CUDA graphs",
    "cpu_kernel": "LAB_CPU_KERNELS=0 skips the CPU kernels",
}


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache, block_size: int, device: torch.device,
                 attention_backend: str = "sdpa", graphs=None, slot_mapping=None) -> None:
        self.model, self.cache, self.block_size, self.device = model, cache, block_size, device
        # fast paths (lab_utils.engine.accel.cuda_graphs.runner_options): flex attention, decode CUDA graphs
        self.attention_backend, self.graphs = attention_backend, graphs
        self.last_hidden: torch.Tensor | None = None  # final hidden states of the returned rows (speculation)
        # (request, first position, hidden states of its computed prompt positions) for prompt-logprob requests
        self.last_prompt_hidden: list[tuple[Request, int, torch.Tensor]] = []
        self.fast_path_error: str | None = None  # the last fast path that failed, and why (the runner fell back)
        self.fast_path_errors: dict[str, str] = {}  # every fast path turned off so far -> why
        # decode rows on a CPU float32 cache: one compiled kernel a layer (cpu_attention), if it could be built
        self.cpu_decode_kernel = attention_backend == "sdpa" and kernel_usable(cache, device)
        # a learner's slot mapping (lab 02): the reference paged attention is the one that uses it
        self.slot_mapping = slot_mapping
        if slot_mapping is not None:
            self.attention_backend, self.graphs, self.cpu_decode_kernel = "sdpa", None, False

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Request, int]], num_padding: int = 0, num_rows: list[int] | None = None
            ) -> tuple[torch.Tensor, list[Request]]:
        """Compute the scheduled tokens; return logits [S, V] for the S requests that reach their last token.

        `num_padding` extra decode rows (static batching's finished members) are computed and thrown away.
        `num_rows[i]` > 1 returns that many trailing rows for entry i (a speculative verify needs k+1)."""
        ids, pos, ctx_lens, q_lens, tables, last_rows, sample_reqs = [], [], [], [], [], [], []
        prompt_rows = []  # (request, first position, flat offset, tokens) of prompt chunks whose logprobs are asked
        for i, (req, n) in enumerate(scheduled):
            start = req.num_computed_tokens
            if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                prompt_rows.append((req, start, len(ids), n))
            ids.extend(req.token_ids[start:start + n])
            pos.extend(range(start, start + n))
            ctx_lens.append(start + n)
            q_lens.append(n)
            tables.append(req.block_table)
            if start + n == req.num_tokens:  # all known tokens computed: the next one can be sampled
                r = num_rows[i] if num_rows else 1
                last_rows.extend(range(len(ids) - r, len(ids)))
                sample_reqs.append(req)
        num_real = len(last_rows)
        if num_padding:
            ids, pos, ctx_lens, q_lens, tables, last_rows = pad_decode_rows(
                ids, pos, ctx_lens, q_lens, tables, last_rows, num_padding)
        hidden = self._forward_or_fall_back(ids, pos, ctx_lens, q_lens, tables)
        self.last_prompt_hidden = [(req, start, hidden[0, off:off + n]) for req, start, off, n in prompt_rows]
        if not last_rows:
            return hidden.new_empty(0, 0), []
        rows = torch.tensor(last_rows, device=self.device)
        logits = self.model.logits(hidden[0, rows]).float()  # padding rows cost their lm head too, then go
        self.last_hidden = hidden[0, rows[:num_real]]
        return logits[:num_real], sample_reqs

    def _forward_or_fall_back(self, ids: list[int], pos: list[int], ctx_lens: list[int], q_lens: list[int],
                              tables: list[list[int]]) -> torch.Tensor:
        for _ in range(len(FAST_PATHS) + 1):  # each fast path can fail (and be turned off) once
            path = self._fast_path(q_lens, len(ids))
            try:
                return self._forward(ids, pos, ctx_lens, q_lens, tables)
            except Exception as err:
                if path is None:
                    raise
                self._turn_off(path, err)
        raise AssertionError("unreachable: every fast path is off after one failure each")

    @torch.inference_mode()
    def warmup(self, batch_sizes: list[int], context_lens: list[int], prefill_len: int, num_blocks: int) -> dict:
        """Compile and capture before the first measured step, as vLLM does at start-up: prefill and decode
        forwards at batch 1 and batch > 1 (flex compiles one kernel per such shape class), and one CUDA graph per
        (batch bucket, context bucket) in `batch_sizes` x `context_lens`.

        The dummy steps write K/V into blocks 0.. of the pool: call it only while no block is in use or cached
        (`LLMEngine.warmup` checks). Returns what it did."""
        from lab_utils.device import synchronize

        t0 = time.perf_counter()
        bs = self.block_size

        def table(L: int) -> list[int]:
            return list(range(-(-L // bs)))

        steps, before = 0, len(self.graphs.entries) if self.graphs is not None else 0
        n = min(prefill_len, num_blocks * bs)
        for b in (1, 2):  # prefill shapes (Q > 1), then eager decode shapes (Q = 1)
            for q in (n, 1):
                self._forward_or_fall_back([0] * (q * b), list(range(q)) * b, [q] * b, [q] * b, [table(q)] * b)
                steps += 1
        for L in sorted(set(context_lens)):
            if self.graphs is None or -(-L // bs) > num_blocks:
                break
            for b in sorted(set(batch_sizes)):
                if not self.graphs.can_run(b):
                    break
                self._forward_or_fall_back([0] * b, [L - 1] * b, [L] * b, [1] * b, [table(L)] * b)
                steps += 1
        synchronize(self.device)
        captured = len(self.graphs.entries) - before if self.graphs is not None else 0
        return {"steps": steps, "graphs": captured, "seconds": time.perf_counter() - t0,
                "fast_path_errors": dict(self.fast_path_errors)}

    def _fast_path(self, q_lens: list[int], n: int) -> str | None:
        """Which fast path this step takes (the one to blame if it fails), None for the plain eager path."""
        if self.graphs is not None and max(q_lens) == 1 and self.graphs.can_run(n):
            return "cuda_graphs"
        if self.attention_backend == "flex":
            return "flex"
        if self.attention_backend == "sdpa" and self.cpu_decode_kernel and min(q_lens) <= MAX_KERNEL_QUERIES:
            return "cpu_kernel"
        return None

    def _turn_off(self, path: str, err: Exception) -> None:
        """A fast path failed on this machine: turn off that one only (the others keep running), say which and
        why, and let the caller redo the step. Re-running is safe: K/V writes are idempotent (same values, same
        slots)."""
        why = _short(err)
        self.fast_path_error = f"{path}: {why}"
        self.fast_path_errors[path] = why
        if path == "cuda_graphs":
            self.graphs = None
        elif path == "flex":
            self.attention_backend = "sdpa"
            self.cpu_decode_kernel = False  # the CPU kernel was never chosen for this engine: keep it that way
        else:
            self.cpu_decode_kernel = False
        on = [p for p, active in (("cuda_graphs", self.graphs is not None), ("flex", self.attention_backend == "flex"),
                                  ("cpu_kernel", self.cpu_decode_kernel)) if active]
        warnings.warn(f"fast path {path!r} failed ({why}); falling back to eager for it alone"
                      f" (still on: {', '.join(on) or 'none'}). {FAST_PATHS[path]}")

    def _forward(self, ids: list[int], pos: list[int], ctx_lens: list[int], q_lens: list[int],
                 tables: list[list[int]]) -> torch.Tensor:
        if self.graphs is not None and max(q_lens) == 1 and self.graphs.can_run(len(ids)):
            return self.graphs.run(ids, pos, ctx_lens, tables)[None]
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)[None]
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)[None]
        attention = self._attention(tables, ctx_lens, q_lens)
        return self.model.hidden_states(input_ids, positions, attention=attention)

    def _attention(self, tables: list[list[int]], ctx_lens: list[int], q_lens: list[int]):
        """The step's attention callable: mixed steps split into decode and prefill groups (split_attention)."""
        if self.slot_mapping is not None:
            meta = AttentionMetadata.build(tables, ctx_lens, q_lens, self.block_size, self.device, self.slot_mapping)
            return PagedAttention(self.cache, meta)
        if self.attention_backend == "sdpa":
            if self.cpu_decode_kernel and min(q_lens) <= MAX_KERNEL_QUERIES:
                return CpuDecodeAttention(self.cache, tables, ctx_lens, q_lens, self.block_size)
            # decode rows in groups of 8 pay off on a CPU; on a GPU they multiply kernels and host syncs
            split = SplitMetadata.build(tables, ctx_lens, q_lens, self.block_size, self.device) \
                if self.device.type == "cpu" else None
            if split is not None:
                return SplitPagedAttention(self.cache, split)
        meta = AttentionMetadata.build(tables, ctx_lens, q_lens, self.block_size, self.device)
        if self.attention_backend == "flex":
            from lab_utils.engine.accel.flex_attention import FlexPagedAttention

            return FlexPagedAttention(self.cache, meta)
        return PagedAttention(self.cache, meta)


def _short(err: Exception, limit: int = 500) -> str:
    """An exception as one readable line: compiler errors carry pages of build output."""
    text = f"{type(err).__name__}: {err}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines[1:] if "error" in ln.lower()]
    text = " | ".join(lines[:1] + errors[:2])
    return text if len(text) <= limit else text[:limit] + " ..."


def pad_decode_rows(ids: list[int], pos: list[int], ctx_lens: list[int], q_lens: list[int],
                    tables: list[list[int]], last_rows: list[int], n: int) -> tuple:
    """Append `n` one-token padding rows to a step, each a copy of the last token of the entry with the longest
    context.

    A copy costs what a padded row costs in a static batch (its attention spans the longest context, as in a
    padded tensor), and it writes the very K/V its original writes to the same slot, so no real token's cache
    changes. Its logits are computed (as `generate` computes them for finished rows) and then dropped."""
    if n < 0:
        raise ValueError(f"num_padding={n} must be >= 0")
    r = max(range(len(ctx_lens)), key=ctx_lens.__getitem__)
    last = sum(q_lens[:r + 1]) - 1  # flat index of entry r's last token
    return (ids + [ids[last]] * n, pos + [pos[last]] * n, ctx_lens + [ctx_lens[r]] * n, q_lens + [1] * n,
            tables + [tables[r]] * n, last_rows + [len(ids) + i for i in range(n)])
