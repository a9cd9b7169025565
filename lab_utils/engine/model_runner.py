"""Turns a scheduled step into one forward pass: flat token ids + positions + attention metadata -> logits
for the requests whose next token is due."""
from __future__ import annotations

import torch

from lab_utils.engine.attention import AttentionMetadata, PagedAttention
from lab_utils.engine.kv_cache import KVCache
from lab_utils.engine.request import Request


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache, block_size: int, device: torch.device) -> None:
        self.model, self.cache, self.block_size, self.device = model, cache, block_size, device
        self.last_hidden: torch.Tensor | None = None  # final hidden states of the returned rows (speculation)

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Request, int]], num_rows: list[int] | None = None
            ) -> tuple[torch.Tensor, list[Request]]:
        """Compute the scheduled tokens; return logits [S, V] for the S requests that reach their last token.
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
        meta = AttentionMetadata.build(tables, ctx_lens, q_lens, self.block_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)[None]
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)[None]
        hidden = self.model.hidden_states(input_ids, positions, attention=PagedAttention(self.cache, meta))
        if not last_rows:
            return hidden.new_empty(0, 0), []
        rows = torch.tensor(last_rows, device=self.device)
        self.last_hidden = hidden[0, rows]
        return self.model.logits(self.last_hidden).float(), sample_reqs
