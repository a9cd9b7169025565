"""Teacher targets: the teacher's greedy continuation of each prompt plus its top-k logits at every position.

One batched pass with a KV cache gives both: the prefill's logits cover the prompt positions and every decode
step's logits cover the token it produces, so soft targets cost nothing beyond generation itself. Only the top
k logits are kept (the tail carries little mass), which keeps the cache small (a few MB per 100k tokens).
Prompts of different lengths share a batch by left padding (positions and masks per row).
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lab_utils.models.kv_cache_simple import SimpleKVCache


class LeftPaddedKVCache(SimpleKVCache):
    """`SimpleKVCache` for prompts of different lengths, left-padded to one length: every row's positions start
    at 0 at its first real token and no query attends to padding, so each row computes what it would alone."""

    def __init__(self, model, pad: torch.Tensor, max_len: int) -> None:
        c = model.config
        super().__init__(c.num_hidden_layers, len(pad), max_len, c.num_key_value_heads, c.head_dim,
                         model.dtype, model.device)
        self.pad = pad.to(model.device)

    def positions(self, num_new: int) -> torch.Tensor:
        pos = torch.arange(self.length, self.length + num_new, device=self.pad.device)
        return (pos[None, :] - self.pad[:, None]).clamp_min(0)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        _B, T = q.shape[:2]
        start, end = self.length, self.length + T
        self.k[layer_idx][:, start:end] = k
        self.v[layer_idx][:, start:end] = v
        keys, values = self.k[layer_idx][:, :end], self.v[layer_idx][:, :end]
        qpos = torch.arange(start, end, device=q.device)[:, None]
        kpos = torch.arange(end, device=q.device)[None, :]
        real = kpos[None] >= self.pad[:, None, None]  # [B, 1, end]
        mask = ((kpos <= qpos)[None] & real) | (kpos == qpos)[None]  # a pad query sees itself only (no NaN)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask[:, None], enable_gqa=True)
        return out.transpose(1, 2)


@torch.no_grad()
def generate_targets(model, prompts: list[tuple[int, ...]], new_tokens: int, top_k: int = 32,
                     batch: int = 32, eos_ids: tuple[int, ...] = (0, 2), deadline: float | None = None,
                     on_batch=None) -> list[dict]:
    """For each prompt: {ids [T] int32, topk_idx [T-1, k] int32, topk_val [T-1, k] fp16, n_prompt}.

    Row t of topk_* is the teacher's prediction for token t+1. Sequences end after the first EOS the teacher
    emits. Prompts of similar length are batched (left-padded). Stops early (returning what is done) once
    `deadline` (time.time()) has passed.
    """
    if new_tokens < 1 or top_k < 1 or batch < 1:
        raise ValueError(f"new_tokens={new_tokens}, top_k={top_k}, batch={batch} must all be >= 1")
    by_len = sorted(prompts, key=len)
    chunks = [by_len[i:i + batch] for i in range(0, len(by_len), batch)]
    random.Random(0).shuffle(chunks)  # a deadline then cuts every kind of prompt evenly
    out: list[dict] = []
    for chunk in chunks:
        if deadline is not None and time.time() > deadline:
            break
        T = max(len(p) for p in chunk)
        pad = torch.tensor([T - len(p) for p in chunk])
        ids = torch.tensor([(0,) * (T - len(p)) + tuple(p) for p in chunk], dtype=torch.long, device=model.device)
        B = len(chunk)
        cache = LeftPaddedKVCache(model, pad, T + new_tokens)
        logits = cache.forward(model, ids).float()
        tk = logits.topk(top_k, dim=-1)
        vals, idxs, toks = [tk.values], [tk.indices], []
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(new_tokens - 1):
            toks.append(nxt)
            lg = cache.forward(model, nxt).float()
            tk = lg.topk(top_k, dim=-1)
            vals.append(tk.values)
            idxs.append(tk.indices)
            nxt = lg[:, -1].argmax(-1, keepdim=True)
        toks.append(nxt)
        seq = torch.cat([ids, *toks], dim=1).cpu()
        val, idx = torch.cat(vals, dim=1).cpu(), torch.cat(idxs, dim=1).cpu()
        for b in range(B):
            p0, end = int(pad[b]), seq.shape[1]
            for j, t in enumerate(seq[b, T:].tolist()):
                if t in eos_ids:
                    end = T + j + 1
                    break
            out.append({"ids": seq[b, p0:end].to(torch.int32), "topk_idx": idx[b, p0:end - 1].to(torch.int32),
                            "topk_val": val[b, p0:end - 1].to(torch.float16), "n_prompt": T - p0})
        if on_batch is not None:
            on_batch(out)
    return out


def save_targets(records: list[dict], path: Path, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"records": records, "meta": meta}, tmp)
    tmp.replace(path)


def load_targets(path: Path) -> tuple[list[dict], dict]:
    d = torch.load(path, weights_only=True)
    return d["records"], d["meta"]
