"""Whether a sampling verifier keeps the target's distribution: a chi-square test of the tokens it emits.

Seeded draws of 2 guesses from a poor draft q (its mass in the wrong places) go through `verify_sampling`; the
first and second emitted token must each be distributed as the target p. A walk that resamples from p instead of
the residual after a rejection over-weights what q likes, and its chi-square lands far above the critical value.
"""
from __future__ import annotations

import torch

P_TOY = (0.35, 0.25, 0.15, 0.12, 0.08, 0.05)
Q_TOY = (0.05, 0.10, 0.40, 0.05, 0.30, 0.10)  # a poor draft: mass in the wrong places
CHI2_CRIT_DF5 = 20.515  # chi-square, 5 degrees of freedom, p-value 0.001


def verify_chi2(walk=None, draws: int = 3000, seed: int = 0) -> tuple[float, float]:
    """Chi-square of the first and second token the engine's sampling verifier (`verify_sampling`, with `walk`
    as its accept/reject) emits, against the target p, over seeded draws of 2 guesses from a poor draft q."""
    from lab_utils.speculative.verify import verify_sampling

    p, q = torch.tensor(P_TOY, dtype=torch.float64), torch.tensor(Q_TOY, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(6), torch.zeros(6)
    for _ in range(draws):
        guesses = torch.multinomial(q, 2, replacement=True, generator=g).tolist()
        out = verify_sampling(p.expand(3, 6), guesses, q.expand(2, 6), g, walk)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    pf = p.float()
    return tuple(float(((c - pf * c.sum()) ** 2 / (pf * c.sum())).sum()) for c in (first, second))
