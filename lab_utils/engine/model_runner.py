"""Turns a scheduled step into one forward pass: flat token ids + positions + attention metadata -> logits
for the requests whose next token is due.

The runner lays the step out (one flat row per scheduled token) and runs the model. What makes it faster is
`accel.FastPaths`: which attention callable serves the step, whether a CUDA graph replays it, and the fallback when
a fast path fails on this machine.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from lab_utils.engine.accel import FastPaths, warm_up
from lab_utils.engine.attention import AttentionMetadata, PagedAttention
from lab_utils.engine.kv.kv_cache import KVCache
from lab_utils.engine.request import Request


def _on_fast_paths(name: str, doc: str) -> property:
    """`ModelRunner.<attribute>` read and set on its `fast_paths.<name>` (tests, benchmarks and
    scripts/gpu_check.py switch fast paths on a built engine's runner)."""
    return property(lambda self: getattr(self.fast_paths, name),
                    lambda self, value: setattr(self.fast_paths, name, value), doc=doc)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache, block_size: int, device: torch.device,
                 fast_paths: FastPaths | None = None, slot_mapping=None) -> None:
        self.model, self.cache, self.block_size, self.device = model, cache, block_size, device
        # flex attention, decode CUDA graphs, the CPU decode kernel (FastPaths.for_engine); default: SDPA, and the
        # CPU kernel where it can run
        self.fast_paths = fast_paths if fast_paths is not None else FastPaths.plain(cache, device)
        if self.fast_paths.graphs is not None:
            self.fast_paths.graphs.model = model  # graphs record the model this runner runs (a fused view)
        self.last_hidden: torch.Tensor | None = None  # final hidden states of the returned rows (speculation)
        # (request, first position, hidden states of its computed prompt positions) for prompt-logprob requests
        self.last_prompt_hidden: list[tuple[Request, int, torch.Tensor]] = []
        # a learner's slot mapping (lab 02): the reference paged attention is the one that uses it
        self.slot_mapping = slot_mapping
        self._rows: torch.Tensor | None = None  # the sampled rows' index, made with an eager step's inputs
        if slot_mapping is not None:
            self.fast_paths.turn_all_off()

    attention_backend = _on_fast_paths("attention_backend", '"sdpa" or "flex" (accel.attention_backends)')
    graphs = _on_fast_paths("graphs", "the decode CUDA graphs (accel.cuda_graphs.DecodeGraphRunner), or None")
    cpu_decode_kernel = _on_fast_paths("cpu_kernel", "decode rows through the compiled CPU kernel")
    fast_path_error = _on_fast_paths("error", "the last fast path that failed, and why (the runner fell back)")
    fast_path_errors = _on_fast_paths("errors", "every fast path turned off so far -> why")

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Request, int]], num_padding: int = 0, num_rows: list[int] | None = None
            ) -> tuple[torch.Tensor, list[Request]]:
        """Compute the scheduled tokens; return logits [S, V] for the S requests that reach their last token.

        `num_padding` extra decode rows (static batching's finished members) are computed and thrown away.
        `num_rows[i]` > 1 returns that many trailing rows for entry i (a speculative verify needs k+1)."""
        ids, pos, ctx_lens, q_lens, tables, last_rows, sample_reqs = [], [], [], [], [], [], []
        prompt_rows = []  # (request, first position, flat offset, tokens) of prompt chunks whose logprobs are asked
        for i, (req, n) in enumerate(scheduled):  # per request per step: kept lean (batch 256 = 256 turns)
            start, tokens, end = req.num_computed_tokens, req.token_ids, req.num_computed_tokens + n
            if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                prompt_rows.append((req, start, len(ids), n))
            if n == 1:  # a decode row
                ids.append(tokens[start])
                pos.append(start)
            else:
                ids.extend(tokens[start:end])
                pos.extend(range(start, end))
            ctx_lens.append(end)
            q_lens.append(n)
            tables.append(req.block_table)
            if end == len(tokens):  # all known tokens computed: the next one can be sampled
                if num_rows:
                    last_rows.extend(range(len(ids) - num_rows[i], len(ids)))
                else:
                    last_rows.append(len(ids) - 1)
                sample_reqs.append(req)
        num_real = len(last_rows)
        if num_padding:
            ids, pos, ctx_lens, q_lens, tables, last_rows = pad_decode_rows(
                ids, pos, ctx_lens, q_lens, tables, last_rows, num_padding)
        self._rows = None
        hidden = self._forward_or_fall_back(ids, pos, ctx_lens, q_lens, tables, last_rows)
        self.last_prompt_hidden = [(req, start, hidden[0, off:off + n]) for req, start, off, n in prompt_rows]
        if not last_rows:
            return hidden.new_empty(0, 0), []
        if last_rows[-1] == len(last_rows) - 1:  # rows 0..k-1 (every decode step): a slice, no index tensor
            picked = hidden[0, :len(last_rows)]
        else:  # the index came with the step's inputs (`_forward`), or (a graph step) on its own
            rows = self._rows if self._rows is not None else _to_device(last_rows, self.device)
            picked = hidden[0, rows]
        logits = self.model.logits(picked).float()  # padding rows cost their lm head too, then go
        self.last_hidden = picked[:num_real]
        return logits[:num_real], sample_reqs

    def _forward_or_fall_back(self, ids: list[int], pos: list[int], ctx_lens: list[int], q_lens: list[int],
                              tables: list[list[int]], rows: list[int] = ()) -> torch.Tensor:
        """The step's forward; where the fast path it takes fails, again without that one (FastPaths.run)."""
        return self.fast_paths.run(lambda: self._forward(ids, pos, ctx_lens, q_lens, tables, rows), q_lens, len(ids))

    def warmup(self, batch_sizes: list[int], context_lens: list[int], prefill_len: int, num_blocks: int) -> dict:
        """Compile and capture before the first measured step (`accel.warmup.warm_up`): call it only while no
        block is in use or cached. Returns what it did."""
        return warm_up(self.fast_paths, self._forward_or_fall_back, self.block_size, self.device, batch_sizes,
                       context_lens, prefill_len, num_blocks)

    def _forward(self, ids: list[int], pos: list[int], ctx_lens: list[int], q_lens: list[int],
                 tables: list[list[int]], rows: list[int] = ()) -> torch.Tensor:
        """Hidden states [1, N, H] of the step. Eager: token ids, positions and the sampled `rows` travel to the
        device as one int64 buffer (the index of `rows` is kept in `self._rows` for `run`)."""
        hidden = self.fast_paths.replay_decode(ids, pos, ctx_lens, q_lens, tables)  # a CUDA graph takes the step
        if hidden is not None:
            return hidden[None]
        n = len(ids)
        packed = _to_device(itertools.chain(ids, pos, rows), self.device, 2 * n + len(rows))
        input_ids, positions, self._rows = packed[:n][None], packed[n:2 * n][None], packed[2 * n:]
        attention = self._attention(tables, ctx_lens, q_lens)
        return self.model.hidden_states(input_ids, positions, attention=attention)

    def _attention(self, tables: list[list[int]], ctx_lens: list[int], q_lens: list[int]):
        """The step's attention callable: the attention backend's (FastPaths.attention), or with a learner's slot
        mapping the reference paged attention over it."""
        if self.slot_mapping is not None:
            meta = AttentionMetadata.build(tables, ctx_lens, q_lens, self.block_size, self.device, self.slot_mapping)
            return PagedAttention(self.cache, meta)
        return self.fast_paths.attention(self.cache, tables, ctx_lens, q_lens, self.block_size, self.device)


def _to_device(values, device: torch.device, count: int = -1) -> torch.Tensor:
    """Python ints -> one int64 tensor on `device` (built in numpy: one host buffer, one copy)."""
    return torch.from_numpy(np.fromiter(values, dtype=np.int64, count=count)).to(device)


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
