"""Per-request sampling settings (names follow vLLM's SamplingParams).

Every field is checked when the object is made, so a bad value fails at the caller with the field's name and
the allowed range, never later inside an engine step where it would take a whole batch down with it.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from lab_utils.structured.params import StructuredOutputParams

MIN_TEMPERATURE = 1e-2  # as vLLM: 0 < t < 0.01 is raised to 0.01 (logits / t would overflow to inf, then NaN)
# top_p below this keeps only the most likely token, as any smaller top_p would (that token's probability is
# >= 1/vocab); raising it keeps the sampler's float32 comparison from rounding a top_p like 1e-181 to 0
MIN_TOP_P = 1e-6
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # a torch.Generator seed is a signed 64-bit integer
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # top logprobs per token (vLLM's default max_logprobs; OpenAI's chat allows 20)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range for frequency_penalty and presence_penalty


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
    # logit processors (the sampler applies them, in this order, to the rows that ask; vLLM's definitions)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    min_tokens: int = 0  # end-of-sequence and stop_token_ids are masked until this many tokens are out
    repetition_penalty: float = 1.0  # > 0: a seen token's logit (prompt + output) / p if positive, * p if not
    frequency_penalty: float = 0.0  # [-2, 2]: minus penalty x the token's count in the output
    presence_penalty: float = 0.0  # [-2, 2]: minus penalty once if the token is in the output
    # log-probabilities: None = off; k = the sampled token's logprob and the k most likely (0 <= k <= 20)
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token after the first

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
            ("logit_bias", self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
                _is_int(t) and t >= 0 and _is_real(b) and abs(b) <= MAX_LOGIT_BIAS
                for t, b in self.logit_bias.items())),
             f"None or a dict of token id (int >= 0) -> a finite bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"),
            ("min_tokens", _is_int(self.min_tokens) and self.min_tokens >= 0
             and (not _is_int(self.max_tokens) or self.min_tokens <= self.max_tokens),
             f"an int in [0, max_tokens={self.max_tokens}]"),
            ("repetition_penalty", _is_real(self.repetition_penalty) and self.repetition_penalty > 0,
             "a finite number > 0 (1 = off)"),
            ("frequency_penalty", _is_real(self.frequency_penalty)
             and PENALTY_RANGE[0] <= self.frequency_penalty <= PENALTY_RANGE[1], "a number in [-2, 2] (0 = off)"),
            ("presence_penalty", _is_real(self.presence_penalty)
             and PENALTY_RANGE[0] <= self.presence_penalty <= PENALTY_RANGE[1], "a number in [-2, 2] (0 = off)"),
            ("logprobs", self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"None or an int in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", self.prompt_logprobs is None
             or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             f"None or an int in [0, {MAX_LOGPROBS}]"),
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
        self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} if self.logit_bias else None
        self.repetition_penalty = float(self.repetition_penalty)
        self.frequency_penalty, self.presence_penalty = float(self.frequency_penalty), float(self.presence_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """True if a logit processor changes this request's logits (its row leaves the plain sampling path)."""
        return bool(self.logit_bias or self.min_tokens or self.repetition_penalty != 1.0
                    or self.frequency_penalty or self.presence_penalty)
