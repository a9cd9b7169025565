"""Per-request sampling settings (names follow vLLM's SamplingParams).

Every field is checked when the object is made, so a bad value fails at the caller with the field's name and
the allowed range, never later inside an engine step where it would take a whole batch down with it.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from lab_utils.engine.structured_params import StructuredOutputParams

MIN_TEMPERATURE = 1e-2  # as vLLM: 0 < t < 0.01 is raised to 0.01 (logits / t would overflow to inf, then NaN)
# top_p below this keeps only the most likely token, as any smaller top_p would (that token's probability is
# >= 1/vocab); raising it keeps the sampler's float32 comparison from rounding a top_p like 1e-181 to 0
MIN_TOP_P = 1e-6
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # a torch.Generator seed is a signed 64-bit integer
MAX_STOP_STRINGS = 16


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    seed: int | None = None  # per-request generator: same seed, same sample, whatever the batch
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # grammar-constrained output (lab 13): a StructuredOutputParams or a dict of its fields, e.g. {"json": schema}
    structured_output: StructuredOutputParams | dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.structured_output = StructuredOutputParams.coerce(self.structured_output)
        checks = [
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "an int >= 1"),
            ("temperature", _is_real(self.temperature) and self.temperature >= 0.0, "a finite number >= 0 (0 = greedy)"),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0, "an int >= 0 (0 = off)"),
            ("top_p", _is_real(self.top_p) and 0.0 < self.top_p <= 1.0, "a number in (0, 1]"),
            ("seed", self.seed is None or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
             f"None or an int in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]"),
            ("stop", isinstance(self.stop, (list, tuple)) and len(self.stop) <= MAX_STOP_STRINGS
             and all(isinstance(s, str) and s for s in self.stop),
             f"a list of at most {MAX_STOP_STRINGS} non-empty strings"),
            ("stop_token_ids", isinstance(self.stop_token_ids, (list, tuple))
             and all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "a list of token ids (ints >= 0)"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "True or False"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: must be {allowed}")
        self.max_tokens, self.top_k = int(self.max_tokens), int(self.top_k)
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        self.top_p = max(self.top_p, MIN_TOP_P)
        self.stop, self.stop_token_ids = list(self.stop), [int(t) for t in self.stop_token_ids]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
