"""Medusa heads (Cai et al. 2024): extra next-next-token heads on the target's own last hidden state.

The target's lm_head turns the hidden state h_t into token t+1. Medusa adds K small heads; head i is a residual
block `h + SiLU(W_i h + b_i)` followed by the SAME (tied, frozen) lm_head and guesses token t+2+i. One target
forward therefore yields 1 + K guesses at the cost of K tiny matmuls: no draft model, no second KV cache.
W_i starts at zero, so an untrained head copies the target's own next-token guess (a sensible start).

This proposer drafts a single chain (the top-1, or one sample, of each head), not Medusa's tree of candidates:
the engine verifies one chain per request. Only the heads are stored (fp16 safetensors + `medusa_config.json`);
the lm_head is the target's tied embedding, never copied.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lab_utils.speculative.base import Proposal, Proposer

CONFIG_NAME = "medusa_config.json"   # not config.json: the model registry treats that as a full model folder
WEIGHTS_NAME = "model.safetensors"
VOCAB_KEY = "draft_vocab"   # int64 token ids of the draft vocabulary (absent: the full vocabulary)
DEFAULT_HEADS = "smollm2-medusa"


class ResBlock(nn.Module):
    """h + SiLU(W h + b), zero-initialised W so the block starts as the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.silu(self.linear(h))


class MedusaHeads(nn.Module):
    """K residual blocks; `forward(h [..., H]) -> [K, ..., H]` features for the target's lm_head."""

    def __init__(self, hidden_size: int, num_heads: int = 4) -> None:
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"num_heads={num_heads} must be >= 1")
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.heads = nn.ModuleList(ResBlock(hidden_size) for _ in range(num_heads))
        self.vocab: torch.Tensor | None = None   # draft vocabulary (token ids), None = the full vocabulary

    def forward(self, h: torch.Tensor, num: int | None = None) -> torch.Tensor:
        return torch.stack([head(h) for head in self.heads[: num or self.num_heads]])

    def config(self) -> dict:
        return {"method": "medusa", "hidden_size": self.hidden_size, "num_heads": self.num_heads,
                "draft_vocab": None if self.vocab is None else len(self.vocab)}


def resolve_heads_dir(name_or_path: str | None, default: str) -> Path:
    """A folder path, or a name under data/models (default `default`). ValueError if neither exists."""
    from lab_utils.paths import DATA_DIR

    name = name_or_path or default
    p = Path(name).expanduser()
    if p.is_dir():
        return p
    q = DATA_DIR / "models" / name
    if q.is_dir():
        return q
    raise ValueError(f"speculative heads {name!r} not found: not a folder and not in {DATA_DIR / 'models'} "
                     f"(default: {default}; train one with scripts/train_*.py)")


class VocabHead:
    """The target's (tied, frozen) lm_head, restricted to a head's draft vocabulary when it has one.

    The lm_head (49k x 576 for SmolLM2) is most of a head step's cost; EAGLE-3 and vLLM let a draft score only
    the V most frequent tokens (a draft vocabulary), which cuts that part by 49152 / V. A token outside the
    draft vocabulary is never proposed (a miss, never a wrong output: the target verifies every guess).
    `vocab` None: the full vocabulary."""

    def __init__(self, target, vocab: torch.Tensor | None) -> None:
        W = target.lm_head.weight.detach()
        self.size = target.config.vocab_size
        self.vocab = None if vocab is None else vocab.to(W.device, torch.long)
        self.weight = W if self.vocab is None else W[self.vocab].contiguous()

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [..., V]."""
        return F.linear(h.to(self.weight.dtype), self.weight)

    def tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> token ids."""
        return idx if self.vocab is None else self.vocab[idx]

    def full(self, probs: torch.Tensor) -> torch.Tensor:
        """A distribution over the draft vocabulary -> the same over the whole vocabulary (zeros elsewhere)."""
        if self.vocab is None:
            return probs
        out = probs.new_zeros(*probs.shape[:-1], self.size)
        return out.index_copy_(-1, self.vocab.to(probs.device), probs)


def top_tokens(labels: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent token ids among `labels` (sorted ids): a draft vocabulary."""
    counts = torch.bincount(labels[labels >= 0].flatten())
    return torch.sort(torch.argsort(counts, descending=True, stable=True)[:size]).values


def save_heads(module: nn.Module, config: dict, folder: str | Path, config_name: str,
               vocab: torch.Tensor | None = None) -> None:
    """fp16 safetensors (+ the int64 draft vocabulary, if any) + config json (no lm_head / embedding: they are
    the target's)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in module.state_dict().items()}
    if vocab is not None:
        state[VOCAB_KEY] = vocab.to("cpu", torch.int64).contiguous()
    save_file(state, str(folder / WEIGHTS_NAME))
    (folder / config_name).write_text(json.dumps(config, indent=2) + "\n")


def load_state(folder: Path, config_name: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    cfg_path = folder / config_name
    if not cfg_path.exists():
        raise ValueError(f"{folder} has no {config_name}: not a folder of {config_name.split('_')[0]} heads")
    return json.loads(cfg_path.read_text()), load_file(str(folder / WEIGHTS_NAME))


def load_medusa(name_or_path: str | None = None) -> MedusaHeads:
    cfg, state = load_state(resolve_heads_dir(name_or_path, DEFAULT_HEADS), CONFIG_NAME)
    heads = MedusaHeads(cfg["hidden_size"], cfg["num_heads"])
    heads.vocab = state.pop(VOCAB_KEY, None)
    heads.load_state_dict({k: v.float() for k, v in state.items()})
    return heads.eval()


def check_target(hidden_size: int, target_model) -> None:
    h = target_model.config.hidden_size
    if h != hidden_size:
        raise ValueError(f"heads were trained for hidden size {hidden_size}, the target model has {h}: "
                         f"use heads trained for this target")


def draw(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None
         ) -> tuple[int, torch.Tensor | None]:
    """Greedy (argmax, no probs) or a sample from softmax(logits / T) together with that distribution.
    `generator`: a seeded generator on the logits' device (None: the device's global RNG, not reproducible)."""
    if temperature <= 0:
        return int(logits.argmax()), None
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator)), probs


class MedusaProposer(Proposer):
    """Proposes min(k, K) tokens: head i's top-1 (greedy) or sample (temperature > 0) from the last hidden state."""

    needs_hidden = True

    def __init__(self, spec_config=None, target_model=None, device: str | torch.device | None = None) -> None:
        if target_model is None:
            raise ValueError("MedusaProposer needs target_model: the heads reuse its lm_head")
        self.target = target_model
        self.heads = load_medusa(getattr(spec_config, "model", None))
        check_target(self.heads.hidden_size, target_model)
        dev = device if device is not None else target_model.device
        self.heads.to(device=dev, dtype=target_model.dtype)
        self.lm = VocabHead(target_model, self.heads.vocab)
        # sampled proposals draw from a seeded generator on the heads' device, as the draft model's do: the same
        # run proposes the same tokens on any device, whatever else used the global RNG
        self.generator = torch.Generator(device=torch.device(dev)).manual_seed(getattr(spec_config, "seed", 0) or 0)

    @torch.no_grad()
    def propose(self, token_ids: list[int], k: int, hidden: torch.Tensor | None = None,
                temperature: float = 0.0) -> Proposal:
        if hidden is None or hidden.numel() == 0:
            raise ValueError("MedusaProposer.propose needs hidden (the target's last hidden state); got None")
        if k < 0:
            raise ValueError(f"k={k} must be >= 0")
        n = min(k, self.heads.num_heads)
        if n == 0:
            return Proposal([])
        h = hidden[-1].to(self.target.dtype)
        logits = self.lm(self.heads(h, n))                      # [n, draft vocabulary]
        if temperature <= 0:
            return Proposal(self.lm.tokens(logits.argmax(-1)).tolist())
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        toks = self.lm.tokens(torch.multinomial(probs, 1, generator=self.generator).squeeze(-1))
        return Proposal(toks.tolist(), self.lm.full(probs))
