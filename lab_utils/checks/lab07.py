"""Checks for lab 07's exercises: the residual distribution, and the accept/reject step of speculative sampling.

Both are checked on fresh random distributions against `lab_utils.spec.verify`, with the uniforms given, so a
result is either right or wrong (no sampling noise). On a mismatch the message says which input, what was
expected and what came back, and names the rule that was missed when it can tell. It never shows the reference.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from lab_utils.spec.verify import accept_probability, residual_distribution


def _pq(gen: torch.Generator, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 3
    q = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 3
    return p / p.sum(), q / q.sum()


def _seed(seed: int | None) -> torch.Generator:
    return torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ()).item()))


# --- exercise 1: the residual ----------------------------------------------------------------------------------
def _residual_hint(p, q, got, expected) -> str:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return f"return a tensor of shape {tuple(expected.shape)}"
    if (got < -1e-9).any():
        return "a probability cannot be negative: clamp p - q at 0 (max(0, p - q))"
    if abs(float(got.sum()) - 1) > 1e-6:
        return "the residual must be normalised to sum to 1"
    if torch.allclose(got, p, atol=1e-9):
        return "you returned p: after a rejection the draw must come from max(0, p - q), normalised"
    return ""


def check_residual(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], seed: int | None = None) -> None:
    """`fn(p [V], q [V]) -> r [V]`: max(0, p - q) normalised; p itself when p == q (nothing to correct)."""
    gen = _seed(seed)
    cases = [_pq(gen, int(torch.randint(2, 40, (), generator=gen))) for _ in range(30)]
    p0 = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    cases += [(p0, p0.clone()), (p0, torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))]
    for p, q in cases:
        expected = residual_distribution(p, q)
        got = fn(p.clone(), q.clone())
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and torch.allclose(got.double(), expected, atol=1e-6):
            continue
        hint = "when p == q, max(0, p - q) is all zeros: fall back to p" if torch.equal(p, q) else \
            _residual_hint(p, q, got, expected)
        raise AssertionError(f"residual(p={p.tolist()}, q={q.tolist()})\n   returned {got}\n   expected {expected}"
                             + (f"\n   hint: {hint}" if hint else ""))
    print(f"check_residual passed: {len(cases)} (p, q) pairs, including p == q")


# --- exercise 2: accept / reject -------------------------------------------------------------------------------
def reference_accept_reject(p: torch.Tensor, q: torch.Tensor, draft: list[int], u: list[float]
                            ) -> tuple[int, torch.Tensor]:
    for i, x in enumerate(draft):
        if not u[i] < accept_probability(p[i], q[i], x):
            return i, residual_distribution(p[i], q[i])
    return len(draft), p[len(draft)]


def check_accept_reject(fn: Callable, seed: int | None = None, cases: int = 60) -> None:
    """`fn(p [k+1, V], q [k, V], draft [k], u [k]) -> (n_accepted, dist [V])`: walk the draft left to right,
    keep token i while u[i] < min(1, p_i(x_i) / q_i(x_i)); return how many were kept and the distribution the
    next token comes from (the residual at the first rejection, p_k after a full accept)."""
    gen = _seed(seed)
    for c in range(cases):
        k, V = int(torch.randint(1, 6, (), generator=gen)), int(torch.randint(3, 12, (), generator=gen))
        pq = [_pq(gen, V) for _ in range(k + 1)]
        p, q = torch.stack([a for a, _ in pq]), torch.stack([b for _, b in pq])[:k]
        draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        ratio = [accept_probability(p[i], q[i], x) for i, x in enumerate(draft)]
        # uniforms just below / above each threshold (and all-accept cases), so every branch is decided
        u = [min(max(r + (0.02 if torch.rand(1, generator=gen) < 0.4 else -0.02), 0.0), 0.999) for r in ratio]
        if c % 5 == 0:
            u = [0.0] * k
        n_exp, d_exp = reference_accept_reject(p, q, draft, u)
        got = fn(p.clone(), q.clone(), list(draft), list(u))
        if not (isinstance(got, tuple) and len(got) == 2):
            raise AssertionError(f"return a tuple (n_accepted, dist), got {type(got).__name__}")
        n_got, d_got = got
        where = f"p_x/q_x = {[round(r, 3) for r in ratio]}, u = {[round(x, 3) for x in u]}"
        if n_got != n_exp:
            hint = "accept while u < min(1, p(x)/q(x)); stop at the first rejection" if n_got > n_exp else \
                "min(1, p(x)/q(x)) is the acceptance probability: accept when u is BELOW it (p(x) >= q(x) always accepts)"
            raise AssertionError(f"case {c}: {where}\n   n_accepted: expected {n_exp}, got {n_got}\n   hint: {hint}")
        if not (isinstance(d_got, torch.Tensor) and d_got.shape == d_exp.shape
                and torch.allclose(d_got.double(), d_exp.double(), atol=1e-6)):
            if n_exp == k:
                hint = f"all {k} accepted: the bonus token comes from p[k], the row after the last draft token"
            elif isinstance(d_got, torch.Tensor) and d_got.shape == d_exp.shape and torch.allclose(d_got.double(), p[n_exp].double()):
                hint = "after a rejection draw from the residual max(0, p - q), not from p"
            else:
                hint = f"after rejecting position {n_exp}, use the residual of p[{n_exp}] and q[{n_exp}]"
            raise AssertionError(f"case {c}: {where}\n   dist: expected {d_exp.tolist()}\n   got {d_got}\n   hint: {hint}")
    print(f"check_accept_reject passed: {cases} chains (full accepts, early and late rejections)")


# --- the lab's closing claims --------------------------------------------------------------------------------

NEAR_TIE = 1e-3  # a greedy output may differ from plain decoding only where the top-2 logits are this close


def claims(r: dict) -> list[tuple[str, bool]]:
    """Lab 07's claims from the run's measurements `r` (built in the notebook's claims cell).

    `gaps`: {config: [top-2 logit gap at each output that differs from plain greedy]}; `acceptance` / `speedup`:
    per engine configuration of section 4."""
    from lab_utils.checks.claims import need

    need(r, "chi2_good", "chi2_bad", "chi2_crit", "worst_z", "gammas", "gaps", "n_configs", "ngram_speedup",
         "verify_cost_ratio", "acceptance", "speedup")
    crit, gaps = r["chi2_crit"], r["gaps"]
    worst_gap = max((g for v in gaps.values() for g in v), default=0.0)
    best_k = max(r["ngram_speedup"], key=r["ngram_speedup"].get)
    best = r["ngram_speedup"][best_k]
    out = [
        (f"speculative sampling keeps p: chi-square {r['chi2_good']:.1f} < {crit}", r["chi2_good"] < crit),
        (f"the negative control (resampling from p instead of the residual) is caught: chi-square "
         f"{r['chi2_bad']:.1f} > {crit}", r["chi2_bad"] > crit),
        (f"check of the verifier (i.i.d. guesses, where the formula's assumption holds): (1 - a^(g+1)) / (1 - a) "
         f"matches the simulation within 4 standard errors (worst {r['worst_z']:.1f}) for g in {list(r['gammas'])}",
         r["worst_z"] < 4),
        (f"greedy output token-identical to plain decoding for {r['n_configs']} speculative configurations, apart "
         f"from near-ties < {NEAR_TIE:g} (worst gap at a difference: {worst_gap:.2g})", worst_gap < NEAR_TIE),
        (f"n-gram lookup pays at batch 1 on copy-heavy prompts: {best:.2f}x wall-time speed-up (k={best_k}); a "
         f"5-token pass costs {r['verify_cost_ratio']:.1f}x a 1-token pass here", best > 1.0),
    ]
    acc = r["acceptance"]
    if "self-draft k=3" in acc and "draft k=4" in acc:  # section 4's reason for the self-draft
        a_self, a_dist = acc["self-draft k=3"] or 0.0, acc["draft k=4"] or 0.0
        out.append((f"the quantized self-draft's guesses are kept more often than the distilled draft's: "
                    f"{a_self:.0%} vs {a_dist:.0%}", a_self > a_dist))
    return out


def assert_claims(r: dict, show: bool = True) -> None:
    """Print lab 07's claims; AssertionError naming each one that fails."""
    from lab_utils.checks.claims import report

    report(claims(r), show)
