"""The verifier of speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

The target model scores the last token plus k proposed tokens in one forward pass, giving k+1 distributions
p_0..p_k. Walking the proposals left to right, proposal x_i (drawn from the draft's q_i) is kept with
probability min(1, p_i(x_i) / q_i(x_i)). At the first rejection we draw a replacement from the residual
max(0, p_i - q_i) / sum(...) and stop; if every proposal survives we draw a bonus token from p_k. Each kept or
drawn token is then distributed exactly as p: speculation changes the speed, never the output distribution.
Greedy decoding is the special case "keep x_i while it is the target's argmax", which makes the output
token-identical to non-speculative greedy decoding.

Each function returns the tokens to append: the accepted proposals followed by one correction/bonus token,
so `len(result) - 1` proposals were accepted and every step produces at least one token. The walk itself is
`accept_reject` (lab 07's learner writes their own, with `residual`; the engine passes it in as `walk`): with the
uniforms given it is deterministic, so a learner's version can be compared case by case.
"""
from __future__ import annotations

import torch


def verify_greedy(target_logits: torch.Tensor, draft_tokens: list[int], walk=None) -> list[int]:
    """target_logits [k+1, V] at (last token, proposals...); keep the proposals that equal the argmax.

    With `walk` (a learner's `accept_reject`), greedy is its special case: p = one-hot of the target's argmax,
    q = one-hot of each guess, so a guess is kept (p/q = 1) exactly when it is the argmax, the residual after a
    rejection is the argmax, and the bonus is the last row's argmax."""
    best = target_logits.argmax(-1).tolist()
    if walk is not None:
        k, vocab = len(draft_tokens), target_logits.shape[-1]
        p = torch.zeros(k + 1, vocab)
        p[torch.arange(k + 1), torch.tensor(best)] = 1.0
        q = torch.zeros(k, vocab)
        q[torch.arange(k), torch.tensor(draft_tokens, dtype=torch.long)] = 1.0
        n, dist = walk(p, q, list(draft_tokens), [0.5] * k)
        return list(draft_tokens[:n]) + [int(dist.argmax())]
    out = []
    for i, tok in enumerate(draft_tokens):
        if best[i] != tok:
            return out + [best[i]]  # the correction: what the target would have produced here
        out.append(tok)
    return out + [best[len(draft_tokens)]]  # all kept: the bonus token comes for free


def accept_probability(p: torch.Tensor, q: torch.Tensor, token: int) -> float:
    """min(1, p(x) / q(x)) for one proposed token x (q(x) > 0 since x was drawn from q)."""
    qx = float(q[token])
    return 1.0 if qx <= 0.0 else min(1.0, float(p[token]) / qx)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where to draw from after a rejection: max(0, p - q), normalised. It puts mass exactly where the target
    wants more than the draft offered; if p == q (nothing to correct) it falls back to p."""
    r = (p - q).clamp_min(0.0)
    total = r.sum()
    return p if total <= 0 else r / total


residual = residual_distribution  # the name lab 07's exercise (and the `spec.residual` part) uses


def accept_reject(p: torch.Tensor, q: torch.Tensor, draft: list[int], u: list[float], residual=None
                  ) -> tuple[int, torch.Tensor]:
    """The walk: keep guess i while u[i] < min(1, p_i(x_i) / q_i(x_i)). Returns (guesses kept, the distribution
    the next token is drawn from): the residual of row n after a rejection at n, p[k] (the bonus) if all k kept.
    p [k+1, V], q [k, V], u: k uniforms in [0, 1). `residual`: another residual function (a learner's)."""
    for i, x in enumerate(draft):
        if not u[i] < accept_probability(p[i], q[i], x):
            return i, (residual or residual_distribution)(p[i], q[i])
    return len(draft), p[len(draft)]


def one_hot(token: int, vocab: int) -> torch.Tensor:
    q = torch.zeros(vocab)
    q[token] = 1.0
    return q


def verify_sampling(target_probs: torch.Tensor, draft_tokens: list[int], draft_probs: torch.Tensor | None,
                    generator: torch.Generator | None = None, walk=None) -> list[int]:
    """Rejection sampling. target_probs [k+1, V] (already tempered/filtered, rows sum to 1); draft_probs
    [k, V] = the q each proposal was drawn from, or None for a deterministic proposer (q = one-hot).
    The k uniforms are drawn first, then the walk (`walk`, default this module's `accept_reject`) decides, then one
    token is drawn from the distribution it returns."""
    p = target_probs.float().cpu()
    k, vocab = len(draft_tokens), p.shape[-1]
    if draft_probs is not None:
        q = draft_probs[:k].float().cpu()
    else:
        q = torch.stack([one_hot(tok, vocab) for tok in draft_tokens]) if k else torch.zeros(0, vocab)
    u = torch.rand(k, generator=generator, dtype=torch.float64).tolist()
    n, dist = (walk or accept_reject)(p, q, list(draft_tokens), u)
    return list(draft_tokens[:n]) + [int(torch.multinomial(dist.float(), 1, generator=generator))]


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """Leviathan et al. eq. 1: with acceptance rate alpha (i.i.d. per position) and gamma proposals, a verify
    step yields (1 - alpha^(gamma+1)) / (1 - alpha) tokens on average (gamma + 1 when alpha = 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} must be in [0, 1]")
    if gamma < 0:
        raise ValueError(f"gamma={gamma} must be >= 0")
    return float(gamma + 1) if alpha == 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
