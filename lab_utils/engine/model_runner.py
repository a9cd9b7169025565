"""Turns a scheduled step into one forward pass: flat token ids + positions + attention metadata -> logits
for the requests whose next token is due."""
from __future__ import annotations

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


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache, block_size: int, device: torch.device,
                 attention_backend: str = "sdpa", graphs=None) -> None:
        self.model, self.cache, self.block_size, self.device = model, cache, block_size, device
        # fast paths (lab_utils.engine.accel.cuda_graphs.runner_options): flex attention, decode CUDA graphs
        self.attention_backend, self.graphs = attention_backend, graphs
        self.last_hidden: torch.Tensor | None = None  # final hidden states of the returned rows (speculation)
        self.fast_path_error: str | None = None  # set when a fast path failed and the runner fell back to eager
        # decode rows on a CPU float32 cache: one compiled kernel a layer (cpu_attention), if it could be built
        self.cpu_decode_kernel = attention_backend == "sdpa" and kernel_usable(cache, device)

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Request, int]], num_padding: int = 0, num_rows: list[int] | None = None
            ) -> tuple[torch.Tensor, list[Request]]:
        """Compute the scheduled tokens; return logits [S, V] for the S requests that reach their last token.

        `num_padding` extra decode rows (static batching's finished members) are computed and thrown away.
        `num_rows[i]` > 1 returns that many trailing rows for entry i (a speculative verify needs k+1)."""
        ids, pos, ctx_lens, q_lens, tables, last_rows, sample_reqs = [], [], [], [], [], [], []
        for i, (req, n) in enumerate(scheduled):
            start = req.num_computed_tokens
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
        try:
            hidden = self._forward(ids, pos, ctx_lens, q_lens, tables)
        except Exception as err:
            if self.attention_backend == "sdpa" and self.graphs is None and not self.cpu_decode_kernel:
                raise
            # A fast path (flex / CUDA graphs / the CPU kernel) failed on this machine: say so loudly, record it,
            # and finish the step on the eager path. Re-running is safe: K/V writes are idempotent (same values,
            # same slots).
            self.fast_path_error = f"{type(err).__name__}: {err}"
            warnings.warn(f"fast path {self.attention_backend!r}/graphs/CPU kernel failed ({self.fast_path_error});"
                          " falling back to eager SDPA attention (enforce_eager=True skips the CUDA fast paths,"
                          " LAB_CPU_KERNELS=0 the CPU kernels)")
            self.attention_backend, self.graphs, self.cpu_decode_kernel = "sdpa", None, False
            hidden = self._forward(ids, pos, ctx_lens, q_lens, tables)
        if not last_rows:
            return hidden.new_empty(0, 0), []
        rows = torch.tensor(last_rows, device=self.device)
        logits = self.model.logits(hidden[0, rows]).float()  # padding rows cost their lm head too, then go
        self.last_hidden = hidden[0, rows[:num_real]]
        return logits[:num_real], sample_reqs

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
        if self.attention_backend == "sdpa":
            if self.cpu_decode_kernel and min(q_lens) <= MAX_KERNEL_QUERIES:
                return CpuDecodeAttention(self.cache, tables, ctx_lens, q_lens, self.block_size)
            split = SplitMetadata.build(tables, ctx_lens, q_lens, self.block_size, self.device)
            if split is not None:
                return SplitPagedAttention(self.cache, split)
        meta = AttentionMetadata.build(tables, ctx_lens, q_lens, self.block_size, self.device)
        if self.attention_backend == "flex":
            from lab_utils.engine.accel.flex_attention import FlexPagedAttention

            return FlexPagedAttention(self.cache, meta)
        return PagedAttention(self.cache, meta)


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
