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
@torch.inference_mode()
def penalize(logits: torch.Tensor, token_ids: list[list[int]], output_ids: list[list[int]], params: list[SamplingParams],
             mask_ids: list[list[int]]) -> torch.Tensor:
    """vLLM's logit processors on rows [n, V], in vLLM's order, all rows at once; returns new rows.

    logit_bias adds its values; min_tokens sets `mask_ids[i]` (end-of-sequence and stop token ids, empty once enough
    tokens are out) to -inf unless that would leave the row no token (a grammar that can only end wins);
    repetition_penalty divides a positive logit / multiplies a negative one of every token seen in `token_ids[i]`
    (prompt + output); frequency_penalty subtracts penalty x count and presence_penalty penalty x (count > 0),
    counted over `output_ids[i]` only (OpenAI's definitions). Each works on the entries it names (gathers and
    scatters over the rows' token ids), not on dense [n, V] masks; min_tokens' guard counts each row's finite
    logits once."""
    n, vocab = logits.shape
    dev = logits.device
    out = logits.float().clone()

    def rows_of(picked: list[int]):  # the rows a processor changes: all of them in place, else a copy
        return slice(None) if len(picked) == n else torch.tensor(picked, device=dev)

    def put(entries: list[tuple[int, int, float]]) -> None:  # out[row, token] += value, for every entry
        if entries:
            rows, toks, vals = zip(*entries)
            out.index_put_((torch.tensor(rows, device=dev), torch.tensor(toks, device=dev)),
                           torch.tensor(vals, device=dev, dtype=out.dtype), accumulate=True)

    put([(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()])
    masked = [(i, t) for i, ids in enumerate(mask_ids) for t in ids if t < vocab]
    if masked:
        rows, toks = (torch.tensor(x, device=dev) for x in zip(*masked))
        finite = torch.isfinite(out[rows, toks])
        lost = torch.zeros(n, device=dev).index_add_(0, rows, finite.float())  # finite logits the mask would take
        keeps = torch.isfinite(out).sum(-1) > lost  # a row keeps some other token: mask it
        sel = keeps[rows]
        out[rows[sel], toks[sel]] = float("-inf")
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 and token_ids[i]]
    if rep:
        width = max(len(token_ids[i]) for i in rep)
        # pad a row with its own first token: scattering the same penalised value twice is harmless
        ids = torch.tensor([token_ids[i] + [token_ids[i][0]] * (width - len(token_ids[i])) for i in rep],
                           dtype=torch.long, device=dev)
        rows = rows_of(rep)
        pen = torch.tensor([params[i].repetition_penalty for i in rep], device=dev)[:, None]
        sub = out[rows]
        seen = sub.gather(1, ids)  # each value read once, before any is written
        out[rows] = sub.scatter_(1, ids, torch.where(seen > 0, seen / pen, seen * pen))
    fp = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if fp:
        width = max(1, max(len(output_ids[i]) for i in fp))
        # sorted output ids, padded with `vocab` (sorts last, weighs 0): a token's first place counts for presence
        ids = torch.tensor([output_ids[i] + [vocab] * (width - len(output_ids[i])) for i in fp],
                           dtype=torch.long, device=dev).sort(dim=1).values
        real = ids < vocab
        first = real.clone()
        first[:, 1:] &= ids[:, 1:] != ids[:, :-1]
        freq = torch.tensor([params[i].frequency_penalty for i in fp], device=dev)[:, None]
        pres = torch.tensor([params[i].presence_penalty for i in fp], device=dev)[:, None]
        rows = rows_of(fp)
        out[rows] = out[rows].scatter_add_(1, ids.clamp_max(vocab - 1), -(freq * real + pres * first))
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
