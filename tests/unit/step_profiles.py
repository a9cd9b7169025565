"""Step logs of the two step-cost profiles the device-true claims are tested under (tests/unit/test_claims_*.py):

- "cpu": a step's cost grows with its tokens (compute-bound, as on a CPU): 1 ms + 0.4 ms per token;
- "launch": a step costs the same whatever its tokens (launch-bound, as small steps on a GPU): 30 ms, +-3 %.

`log(tokens, profile)` builds an `LLMEngine.step_log` whose steps compute `tokens[i]` tokens and last what the
profile charges, with a little seeded jitter (a real log is never exact)."""
from __future__ import annotations

import random

PROFILES = {"cpu": (1e-3, 4e-4), "launch": (30e-3, 0.0)}  # (fixed s, s per token)


def step_cost(tokens: int, profile: str) -> float:
    fixed, per_token = PROFILES[profile]
    return fixed + per_token * tokens


def log(tokens: list[int], profile: str, padding: list[int] | None = None, seed: int = 0) -> list[dict]:
    """A step log of len(tokens) steps (`padding[i]` padding rows beside `tokens[i]` real ones)."""
    rng = random.Random(seed)
    padding = padding or [0] * len(tokens)
    out, t = [], 0.0
    for i, (n, pad) in enumerate(zip(tokens, padding)):
        dt = step_cost(n + pad, profile) * rng.uniform(0.97, 1.03)
        out.append({"step": i + 1, "start": t, "end": t + dt, "num_tokens": n, "num_padding": pad, "requests": []})
        t += dt + 1e-4
    return out


def seconds(log_: list[dict]) -> float:
    return sum(s["end"] - s["start"] for s in log_)
