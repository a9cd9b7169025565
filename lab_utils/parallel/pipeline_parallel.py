"""Pipeline parallelism: consecutive layers on consecutive ranks, hidden states passed with send/recv.

Rank 0 embeds the tokens and runs the first layers, sends its hidden states [B, T, H] to rank 1, ..., and the
last rank runs the final norm + lm_head, picks the greedy token and broadcasts it so every stage can feed the
next step. With one sequence in flight the stages take turns (a pipeline "bubble": one rank idles while the
other works); filling the pipeline needs several micro-batches in flight, which this teaching version leaves out.
"""
from __future__ import annotations

import torch
from torch import nn

from lab_utils.parallel.comm import Comm
from lab_utils.parallel.tensor_parallel import shard_range


class PipelineStage:
    """This rank's slice of the model: `layers[start:end]`, plus the embedding (first) or norm + head (last)."""

    def __init__(self, model: nn.Module, comm: Comm) -> None:
        cfg = model.config
        if cfg.num_hidden_layers < comm.world_size:
            raise ValueError(f"world_size={comm.world_size} is larger than num_hidden_layers={cfg.num_hidden_layers}")
        self.model, self.comm = model, comm
        self.start, self.end = shard_range(cfg.num_hidden_layers, comm.world_size, comm.rank)
        self.first, self.last = comm.rank == 0, comm.rank == comm.world_size - 1
        # drop the other stages' layers, as a real deployment would never load them
        for i, layer in enumerate(model.model.layers):
            if not self.start <= i < self.end:
                model.model.layers[i] = nn.Identity()

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, positions: torch.Tensor, attention) -> int:
        """One forward pass of the whole pipeline for ids [1, T]; every rank returns the same next token."""
        m, comm = self.model, self.comm
        H = m.config.hidden_size
        if self.first:
            x = m.model.embed_tokens(ids)
        else:
            x = comm.recv((ids.shape[0], ids.shape[1], H), m.dtype, src=comm.rank - 1)
        cos, sin = m.model.rotary_emb(positions, x.dtype)
        for layer in m.model.layers[self.start:self.end]:
            x = layer(x, cos, sin, attention)
        tok = torch.zeros(1, dtype=torch.long, device=ids.device)
        if not self.last:
            comm.send(x, dst=comm.rank + 1)
        else:
            tok[0] = m.logits(m.model.norm(x[:, -1:]))[0, -1].argmax()
        comm.broadcast(tok, src=comm.world_size - 1)
        return int(tok.item())
