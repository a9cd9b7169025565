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
    None if even a = 1 does not pay (k + 1 tokens <= cost); 0.0 if the cost is at most one plain step (it
    cannot be, physically: `consistency_problems` refuses that)."""
    cost = verify_cost + k * step_cost
    if k + 1 <= cost:
        return None
    if cost <= 1:
        return 0.0
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if expected_tokens([mid] * k) < cost:
            lo = mid
        else:
            hi = mid
    return hi


PREDICTION_FACTOR = 1.5  # a measured speed-up must lie within this factor of the predicted one, either way
NOISE = 0.15             # timing noise allowed before two figures of one run are called contradictory
SMOKE_SKIP = "skipped in SMOKE: too small to measure"


def consistency_problems(name: str, verify_cost: float, tokens_per_verify: float | None = None,
                         measured: float | None = None, breakeven: float | None = None,
                         noise: float = NOISE) -> list[str]:
    """What in one proposer's figures cannot all be true at once (empty if nothing):
    - a verify pass over k+1 rows measured cheaper than a pass over one row (below 1 / (1 + noise));
    - a speed-up above tokens per verify step / verify cost: a verify step (guessing included) costs at least
      the target's (k+1)-row pass, and yields its tokens, so no more than that ratio;
    - a break-even acceptance of 0: guessing and verifying would cost no more than one plain step."""
    out = []
    if verify_cost < 1 / (1 + noise):
        out.append(f"{name}: the verify pass was measured at v = {verify_cost:.2f}x one row: a pass over more rows "
                   f"cannot cost less than over one (a timing taken during a load spike?)")
    if tokens_per_verify is not None and measured is not None:
        ceiling = tokens_per_verify / max(verify_cost, 1.0)
        if measured > ceiling * (1 + noise):
            out.append(f"{name}: measured {measured:.2f}x, above the {ceiling:.2f}x that {tokens_per_verify:.2f} "
                       f"tokens per verify step at v = {max(verify_cost, 1.0):.2f} can give")
    if breakeven is not None and breakeven <= 0:
        out.append(f"{name}: break-even acceptance 0: the step's cost came out at most one plain step (v and c are "
                   f"mis-measured)")
    return out


def check_payoff(rows: dict[str, dict], verify_cost: float, k: int, factor: float = PREDICTION_FACTOR,
                 noise: float = NOISE, smoke: bool = False) -> list[str]:
    """rows: {proposer: {"tokens_per_verify": E, "step_cost": c, "measured": speed-up}}, all from one run, with
    the run's verify cost v of a (k+1)-row pass. Refuses (AssertionError naming each) figures that contradict
    each other (`consistency_problems`) and a measured speed-up further than `factor` from E / (v + k c), v counted
    as at least 1. In SMOKE the speed-ups of a one-prompt run are noise: the comparisons that use them say so
    instead of passing or failing. Returns one line per proposer."""
    out, problems = [], []
    v = max(verify_cost, 1.0)  # a (k+1)-row pass costs at least a 1-row pass; below it is timing noise
    for name, row in rows.items():
        E, c, meas = row["tokens_per_verify"], row["step_cost"], row["measured"]
        pred = predicted_speedup(E, k, c, v)
        be = breakeven_acceptance(k, c, v)
        problems += consistency_problems(name, verify_cost, None if smoke else E, None if smoke else meas, be, noise)
        if smoke:
            out.append(f"{name}: predicted {pred:.2f}x from E = {E:.2f}, c = {c:.3f}, v = {v:.2f}; measured vs "
                       f"predicted {SMOKE_SKIP}")
            continue
        within = 1 / factor <= meas / pred <= factor
        if not within:
            problems.append(f"{name}: predicted {pred:.2f}x, measured {meas:.2f}x: more than {factor}x apart (a cost "
                            f"or an acceptance is mis-measured, or the step has a cost the arithmetic leaves out)")
            continue
        verdict = "pays" if meas > 1 + noise / 3 else "does not pay" if meas < 1 - noise / 3 else "breaks even"
        out.append(f"{name}: predicted {pred:.2f}x, measured {meas:.2f}x (within {factor}x): {verdict}")
    assert not problems, "the payoff figures of this run contradict each other:\n  " + "\n  ".join(problems)
    return out
