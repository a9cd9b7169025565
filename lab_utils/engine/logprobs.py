"""Log-probabilities of the tokens a request produced (and of its prompt), for the requests that ask.

A generated token's logprobs come from the logits the sampler drew it from: after the grammar mask, logit_bias,
min_tokens and the penalties, before temperature, top-k and top-p (so they do not change with temperature, as
OpenAI's do not). A prompt token's come from the plain logits of the position before it. Each is one log_softmax
over the rows that ask, on the device, and one copy of the few numbers kept to the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the k most likely (token id, logprob), most likely first


@torch.inference_mode()
def logprobs_of(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """logits [n, V]: row i scored before `tokens[i]`; its logprob and its `ks[i]` most likely tokens."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    k = min(max(ks), lp.shape[-1])
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    return [TokenLogprob(t, c, tuple(zip(ids[:n], vals[:n])))
            for t, c, ids, vals, n in zip(tokens, chosen, top_ids, top_lp, ks)]


def sampled_logprobs(logits: torch.Tensor, reqs: list, new_tokens: list[list[int]], rows: list[int] | None = None
                     ) -> list[list[TokenLogprob] | None]:
    """Per request: the logprobs of its new tokens (None if it did not ask). `reqs[i]` owns `rows[i]` consecutive
    rows (default 1); after a speculative verify, row j scored new token j (a kept guess, then the correction or
    bonus), so the same rows give every emitted token's logprobs."""
    out: list[list[TokenLogprob] | None] = [None] * len(reqs)
    starts, r = [], 0
    for n in rows or [1] * len(reqs):
        starts.append(r)
        r += n
    index, tokens, ks, owners = [], [], [], []
    for i, (req, toks) in enumerate(zip(reqs, new_tokens)):
        if req.params.logprobs is None:
            continue
        for j, tok in enumerate(toks):
            index.append(starts[i] + j)
            tokens.append(tok)
            ks.append(req.params.logprobs)
            owners.append(i)
        out[i] = []
    if index:
        scored = logprobs_of(logits[torch.tensor(index, device=logits.device)], tokens, ks)
        for i, entry in zip(owners, scored):
            out[i].append(entry)
    return out


@torch.inference_mode()
def record_prompt_logprobs(model, chunks: list[tuple]) -> None:
    """`chunks`: (request, first position, hidden states of the positions computed this step) for the requests
    that asked for prompt logprobs. Position p scores prompt token p + 1; `req.prompt_logprobs[t]` is token t's
    entry (None for token 0). A chunk recomputed after a preemption adds only what is missing."""
    for req, start, hidden in chunks:
        have = len(req.prompt_logprobs)
        end = min(start + hidden.shape[0], req.num_prompt_tokens - 1)  # positions start..end-1 score tokens +1
        if start + 1 > have:
            raise RuntimeError(f"prompt logprobs of {req.request_id}: positions {have - 1}..{start - 1} were never "
                               f"computed (a prefix-cache hit): prompt-logprob requests must skip the prefix cache")
        first = have - 1  # the first position whose entry is missing
        if end <= first:
            continue
        logits = model.logits(hidden[first - start:end - start]).float()
        targets = req.prompt_token_ids[first + 1:end + 1]
        req.prompt_logprobs.extend(logprobs_of(logits, targets, [req.params.prompt_logprobs] * len(targets)))
