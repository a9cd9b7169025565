"""Per-request sampling settings (names follow vLLM's SamplingParams)."""
from __future__ import annotations

from dataclasses import dataclass, field


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "an int >= 1"),
            ("temperature", self.temperature >= 0.0, ">= 0 (0 = greedy)"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an int >= 0 (0 = off)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: must be {allowed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
