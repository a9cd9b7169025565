"""Step logs of the step-cost profiles the device-true claims are tested under (tests/unit/test_claims_*.py):

- "cpu": a step's cost grows with its tokens (compute-bound, as on a CPU): 1 ms + 0.4 ms per token;
- "launch": a step costs the same whatever its tokens (launch-bound, as small steps on a GPU): 30 ms;
- "gpu": the H200 run's shape: decode-only steps replay CUDA graphs (5 ms + 0.02 ms per row), a step with any
  prompt token runs eagerly (100 ms + 0.01 ms per token).

`log(tokens, profile, decode=...)` builds an `LLMEngine.step_log` whose steps compute `tokens[i]` tokens (one
request per row in a decode-only step, one request otherwise) and last what the profile charges, with a little
seeded jitter (a real log is never exact)."""
from __future__ import annotations

import random

# (fixed s, s per token) of steps with prompt tokens, and of decode-only steps
PROFILES = {"cpu": ((1e-3, 4e-4), (1e-3, 4e-4)), "launch": ((30e-3, 0.0), (30e-3, 0.0)),
            "gpu": ((100e-3, 1e-5), (5e-3, 2e-5))}


def step_cost(tokens: int, profile: str, decode_only: bool = False) -> float:
    fixed, per_token = PROFILES[profile][1 if decode_only else 0]
    return fixed + per_token * tokens


def log(tokens: list[int], profile: str, padding: list[int] | None = None, seed: int = 0,
        decode: list[bool] | None = None) -> list[dict]:
    """A step log of len(tokens) steps (`padding[i]` padding rows beside `tokens[i]` real ones; `decode[i]`: a
    decode-only step, default none)."""
    rng = random.Random(seed)
    padding = padding or [0] * len(tokens)
    decode = decode or [False] * len(tokens)
    out, t = [], 0.0
    for i, (n, pad, dec) in enumerate(zip(tokens, padding, decode)):
        dt = step_cost(n + pad, profile, dec) * rng.uniform(0.97, 1.03)
        requests = [(str(j), 1) for j in range(n)] if dec else [("p", n)]
        out.append({"step": i + 1, "start": t, "end": t + dt, "num_tokens": n, "num_padding": pad,
                    "requests": requests})
        t += dt + 1e-4
    return out


def seconds(log_: list[dict]) -> float:
    return sum(s["end"] - s["start"] for s in log_)
