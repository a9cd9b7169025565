"""An EAGLE-style draft head (Li et al. 2024): autoregression on the target's FEATURES, not on tokens.

The target's last hidden state f_t already summarises the whole context, so predicting the next feature is
easier than predicting the next token from scratch. The head takes (f_t, embedding of x_{t+1}) -> a linear
`fc` over their concatenation -> one Llama decoder layer -> the predicted feature f_{t+1}; the target's own
(tied, frozen) lm_head turns it into the distribution of x_{t+2}. To draft k tokens it feeds its predicted
feature and the token it chose back in, k times. Training: smooth-L1 feature regression + cross-entropy
against the target's greedy token (through the frozen lm_head), on cached target features.

Context: the engine hands the proposer only the hidden rows of the tokens the target just verified (1 after a
prefill, num_accepted + 1 after a verify step, see `base.py`); the proposer keeps each request's recent rows
(up to `window`) across calls, so the head attends over the last `window` true rows plus its own draft steps.
It is trained with short sliding windows of random width (1..window), so a short context (a fresh request,
a proposer used without request ids) is a case it has seen. Only the head is stored (fp16 safetensors +
`eagle_config.json`); the token embedding and lm_head are the target's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lab_utils.models.llama import LlamaConfig, LlamaDecoderLayer, RotaryEmbedding
from lab_utils.speculative.base import Proposal, Proposer
from lab_utils.speculative.medusa import VOCAB_KEY, VocabHead, check_target, load_state, resolve_heads_dir

CONFIG_NAME = "eagle_config.json"   # not config.json: the model registry treats that as a full model folder
DEFAULT_HEADS = "smollm2-eagle"


def window_attention(width: int):
    """Causal attention in which each row sees itself and at most `width - 1` rows before it."""

    def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T = q.shape[1]
        i = torch.arange(T, device=q.device)
        d = i[:, None] - i[None, :]
        mask = (d >= 0) & (d < width)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2)

    return attend


class EagleHead(nn.Module):
    """(features [B, T, H], token embeddings [B, T, H]) -> predicted next features [B, T, H]."""

    def __init__(self, cfg: LlamaConfig, window: int = 8) -> None:
        super().__init__()
        self.cfg, self.window = cfg, window
        self.vocab: torch.Tensor | None = None   # draft vocabulary (token ids), None = the full vocabulary
        H = cfg.hidden_size
        self.fc = nn.Linear(2 * H, H)
        self.layer = LlamaDecoderLayer(cfg, 0)
        self.rotary = RotaryEmbedding(cfg)

    def forward(self, feats: torch.Tensor, embeds: torch.Tensor, width: int | None = None) -> torch.Tensor:
        x = self.fc(torch.cat([feats, embeds], dim=-1))
        pos = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        cos, sin = self.rotary(pos, x.dtype)
        return self.layer(x, cos, sin, window_attention(width or self.window))

    def config(self) -> dict:
        c = self.cfg
        return {"method": "eagle", "window": self.window, "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
                "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
                "draft_vocab": None if self.vocab is None else len(self.vocab)}


def eagle_config_for(target_cfg: LlamaConfig, window: int = 8) -> LlamaConfig:
    """One decoder layer shaped like the target's layers (so the feature sizes match)."""
    c = target_cfg
    return LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                       num_hidden_layers=1, num_attention_heads=c.num_attention_heads,
                       num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                       rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta)


def load_eagle(name_or_path: str | None = None) -> EagleHead:
    cfg, state = load_state(resolve_heads_dir(name_or_path, DEFAULT_HEADS), CONFIG_NAME)
    skip = ("method", "window", "target", "vocab_size", "draft_vocab")
    lc = LlamaConfig(**{k: v for k, v in cfg.items() if k not in skip}, num_hidden_layers=1)
    head = EagleHead(lc, cfg["window"])
    head.vocab = state.pop(VOCAB_KEY, None)
    head.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = set(head.state_dict()) - set(state) - {"rotary.inv_freq"}
    if missing:
        raise ValueError(f"EAGLE weights are missing {sorted(missing)}")
    return head.eval()


class EagleProposer(Proposer):
    """Drafts k tokens by feature-level autoregression over the rows the engine hands over (see module doc)."""

    needs_hidden = True

    def __init__(self, spec_config=None, target_model=None, device: str | torch.device | None = None) -> None:
        if target_model is None:
            raise ValueError("EagleProposer needs target_model: the head reuses its embedding and lm_head")
        self.target = target_model
        self.head = load_eagle(getattr(spec_config, "model", None))
        check_target(self.head.cfg.hidden_size, target_model)
        dev = device if device is not None else target_model.device
        self.head.to(device=dev, dtype=target_model.dtype)
        self.head.rotary.inv_freq = self.head.rotary.inv_freq.float()
        self.lm = VocabHead(target_model, self.head.vocab)
        # sampled proposals: a seeded generator on the head's device (as the draft model's), never the global RNG
        self.generator = torch.Generator(device=torch.device(dev)).manual_seed(getattr(spec_config, "seed", 0) or 0)
        self.history: dict[str, tuple[int, torch.Tensor]] = {}   # request -> (position of row 0, rows [m, H])

    def _with_history(self, first: int, rows: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Prepend the rows of earlier positions kept from this request's previous calls (the engine sets
        `self.request_id` before each call), so the head sees up to `window` true rows, not just the new ones."""
        rid = getattr(self, "request_id", None)
        if rid is not None and rid in self.history:
            start, old = self.history[rid]
            if start <= first <= start + old.shape[0]:
                rows, first = torch.cat([old[: first - start], rows]), start
        keep = min(rows.shape[0], self.head.window)
        rows, first = rows[rows.shape[0] - keep:], first + rows.shape[0] - keep
        if rid is not None:
            self.history[rid] = (first, rows)
        return first, rows

    def release(self, request_id: str) -> None:
        self.history.pop(request_id, None)

    @torch.no_grad()
    def propose(self, token_ids: list[int], k: int, hidden: torch.Tensor | None = None,
                temperature: float = 0.0) -> Proposal:
        if hidden is None or hidden.numel() == 0:
            raise ValueError("EagleProposer.propose needs hidden (the target's last hidden states); got None")
        if k < 0:
            raise ValueError(f"k={k} must be >= 0")
        if k == 0:
            return Proposal([])
        hidden = hidden.reshape(-1, hidden.shape[-1]).to(self.target.dtype)
        L, n = len(token_ids), min(hidden.shape[0], len(token_ids) - 1)
        if n < 1:
            return Proposal([])
        first, feats = self._with_history(L - 1 - n, hidden[hidden.shape[0] - n:])
        feats = feats[None]
        toks = torch.tensor(token_ids[first + 1:], device=hidden.device)[None]  # row j: (f_p, x_{p+1})
        out, probs = draft_chain(self.head, self.target, feats, toks, k, temperature, self.lm, self.generator)
        return Proposal(out[0].tolist(), None if probs is None else probs[0])


@torch.no_grad()
def draft_chain(head: EagleHead, target, feats: torch.Tensor, toks: torch.Tensor, k: int,
                temperature: float = 0.0, lm: VocabHead | None = None, generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """feats [B, n, H], toks [B, n] (row j pairs feature f_p with token x_{p+1}) -> k draft tokens [B, k]
    (and their distributions [B, k, vocab] when sampling). Each step appends (predicted feature, chosen token).
    `lm`: the (draft-vocabulary) lm_head to score with; built from `head.vocab` when None. `generator`: seeded, on
    the features' device, for sampling (None: the device's global RNG)."""
    embed = target.model.embed_tokens
    lm = lm if lm is not None else VocabHead(target, head.vocab)
    out, rows = [], []
    for _ in range(k):
        w = head.window
        nxt = head(feats[:, -w:], embed(toks[:, -w:]))[:, -1]       # [B, H] predicted feature of the newest token
        logits = lm(nxt)
        if temperature <= 0:
            tok = lm.tokens(logits.argmax(-1))
        else:
            p = torch.softmax(logits.float() / temperature, dim=-1)
            tok = lm.tokens(torch.multinomial(p, 1, generator=generator).squeeze(-1))
            rows.append(lm.full(p))
        out.append(tok)
        feats = torch.cat([feats, nxt[:, None]], dim=1)
        toks = torch.cat([toks, tok[:, None]], dim=1)
    return torch.stack(out, dim=1), (torch.stack(rows, dim=1) if rows else None)
