"""From logits to the next token: greedy, temperature, top-k, top-p, each request with its own generator; before
that, the logit processors of the requests that ask for them (logit bias, min_tokens, penalties)."""
from __future__ import annotations

import torch

from lab_utils.engine.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] -> logits with tokens outside the top-k / the top-p nucleus set to -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token if the tokens ranked above it already reach top_p (the best token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.greedy:
        return int(logits.argmax())
    logits = apply_top_k_top_p(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = logits.softmax(-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, V] -> B token ids. All-greedy batches take one argmax on the device."""
    if all(p.greedy for p in params):
        return logits.argmax(-1).tolist()
    return [sample_one(logits[i], p, g) for i, (p, g) in enumerate(zip(params, generators))]


# -- logit processors ------------------------------------------------------------------------------------------
def _padded(lists: list[list[int]], pad: int, device) -> torch.Tensor:
    """[n, longest] token ids, short rows filled with `pad` (a column past the vocabulary, dropped afterwards)."""
    width = max(1, max(len(x) for x in lists))
    return torch.tensor([x + [pad] * (width - len(x)) for x in lists], dtype=torch.long, device=device)


@torch.inference_mode()
def penalize(logits: torch.Tensor, token_ids: list[list[int]], output_ids: list[list[int]], params: list[SamplingParams],
             mask_ids: list[list[int]]) -> torch.Tensor:
    """vLLM's logit processors on rows [n, V], in vLLM's order, all rows at once; returns new rows.

    logit_bias adds its values; min_tokens sets `mask_ids[i]` (end-of-sequence and stop token ids, empty once enough
    tokens are out) to -inf unless that would leave the row no token (a grammar that can only end wins);
    repetition_penalty divides a positive logit / multiplies a negative one of every token seen in `token_ids[i]`
    (prompt + output); frequency_penalty subtracts penalty x count and presence_penalty penalty x (count > 0),
    counted over `output_ids[i]` only (OpenAI's definitions)."""
    n, vocab = logits.shape
    dev = logits.device
    out = logits.float().clone()
    bias = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
    if bias:
        rows, toks, vals = zip(*bias)
        out.index_put_((torch.tensor(rows, device=dev), torch.tensor(toks, device=dev)),
                       torch.tensor(vals, device=dev), accumulate=True)
    masked = [(i, t) for i, ids in enumerate(mask_ids) for t in ids if t < vocab]
    if masked:
        rows, toks = zip(*masked)
        hidden = out.index_put((torch.tensor(rows, device=dev), torch.tensor(toks, device=dev)),
                               torch.tensor(float("-inf"), device=dev))
        alive = ~torch.isneginf(hidden).all(-1, keepdim=True)
        out = torch.where(alive, hidden, out)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=dev)
        seen.scatter_(1, _padded(token_ids, vocab, dev), True)
        pen = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
        out = torch.where(seen[:, :vocab], torch.where(out > 0, out / pen, out * pen), out)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        ids = _padded(output_ids, vocab, dev)
        counts = torch.zeros(n, vocab + 1, device=dev).scatter_add_(1, ids, torch.ones_like(ids, dtype=out.dtype))
        counts = counts[:, :vocab]
        freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
        out = out - freq * counts - pres * (counts > 0).to(out.dtype)
    return out


@torch.inference_mode()
def apply_logit_processors(logits: torch.Tensor, reqs: list, stop_ids: set[int], rows: list[int] | None = None
                           ) -> torch.Tensor:
    """The rows of requests whose params ask for a logit processor go through `penalize` (in place, one batched
    call); every other row is untouched and a batch where nobody asks costs one pass over the params.
    `reqs[i]` owns `rows[i]` consecutive rows (default 1); a request that asks owns exactly one (speculation is
    off for it: its penalties depend on every token before)."""
    asking = [i for i, r in enumerate(reqs) if r.params.processes_logits]
    if not asking:
        return logits
    starts, r = [], 0
    for n in rows or [1] * len(reqs):
        starts.append(r)
        r += n
    picked = [reqs[i] for i in asking]
    index = torch.tensor([starts[i] for i in asking], device=logits.device)
    masks = [sorted(stop_ids | set(q.params.stop_token_ids)) if q.num_output_tokens < q.params.min_tokens else []
             for q in picked]
    logits[index] = penalize(logits[index], [q.token_ids for q in picked], [q.output_token_ids for q in picked],
                             [q.params for q in picked], masks).to(logits.dtype)
    return logits
