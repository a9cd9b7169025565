"""When speculation pays: the arithmetic of one verify step, in units of one plain target decode step.

A verify step costs `verify_cost` (the target's (k+1)-row pass over a 1-row pass: ~1 on a GPU at batch 1,
where a step is bound by reading the weights; more on a CPU, where arithmetic shows) plus `k * c` (k proposer
steps, each c target steps). It yields E = 1 + a_1 + a_1 a_2 + ... tokens (a_i: the conditional acceptance at
depth i). Plain decoding yields 1 token per target step, so the speed-up is E / (verify_cost + k c), and
speculation pays when that exceeds 1.
"""
from __future__ import annotations


def expected_tokens(conditional: list[float]) -> float:
    """Tokens per verify step from the conditional acceptance at each depth (the accepted guesses + 1)."""
    total, run = 1.0, 1.0
    for a in conditional:
        run *= a
        total += run
    return total


def predicted_speedup(tokens_per_verify: float, k: int, step_cost: float, verify_cost: float) -> float:
    """E / (verify_cost + k c)."""
    if tokens_per_verify < 1 or k < 0 or step_cost < 0 or verify_cost <= 0:
        raise ValueError(f"need tokens_per_verify >= 1, k >= 0, step_cost >= 0, verify_cost > 0; got "
                         f"{tokens_per_verify}, {k}, {step_cost}, {verify_cost}")
    return tokens_per_verify / (verify_cost + k * step_cost)


def breakeven_acceptance(k: int, step_cost: float, verify_cost: float, tol: float = 1e-6) -> float | None:
    """The acceptance a (the same at every depth) at which E(a) = 1 + a + ... + a^k equals the step's cost;
    None if even a = 1 does not pay (k + 1 tokens <= cost)."""
    cost = verify_cost + k * step_cost
    if k + 1 <= cost:
        return None
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if expected_tokens([mid] * k) < cost:
            lo = mid
        else:
            hi = mid
    return hi


def check_payoff(rows: dict[str, tuple[float, float]], margin: float = 0.2, noise: float = 0.1) -> list[str]:
    """rows: {proposer: (predicted speed-up, measured speed-up)}. Where the arithmetic is clear (the prediction
    is more than `margin` away from 1), the measurement must not land on the other side of 1 by more than
    `noise` (timing noise: a few tokens of a short run move a measured speed-up by several percent). Returns the
    claims; AssertionError naming the proposer otherwise."""
    out = []
    for name, (pred, meas) in rows.items():
        if abs(pred - 1) <= margin:
            out.append(f"{name}: predicted {pred:.2f}x is too close to 1 to call; measured {meas:.2f}x")
            continue
        wrong_side = (1 - meas) if pred > 1 else (meas - 1)
        assert wrong_side <= noise, (f"{name}: the arithmetic predicts {pred:.2f}x but {meas:.2f}x was measured "
                                     f"(a cost or an acceptance is mis-measured)")
        out.append(f"{name}: predicted {pred:.2f}x, measured {meas:.2f}x: {'pays' if pred > 1 else 'does not pay'}"
                   + ("" if (pred > 1) == (meas > 1) else f" (measured within {noise:.2f} of 1: timing noise)"))
    return out
