"""A draft model proposes: a small model with the target's tokenizer runs k cheap autoregressive steps.

The draft keeps its own contiguous KV cache per request (`SimpleKVCache`, lab 00's cache). It never needs to
be told about rejections: each call compares the cached tokens with the request's current tokens and rewinds
the cache to their common prefix (its length counter drops; stale slots are overwritten later), then feeds
only the tokens it has not seen. In steady state that is 1-2 tokens of catch-up plus k-1 one-token steps.

A self-draft (the target's own weights, usually quantized: `SpecConfig(model=<the target>, quantization=...)`)
does not prefill the prompt itself: its layers compute the same keys and values as the target's, so it copies
them from the target's paged cache (`shares_target_kv`, `Proposer.target_kv`). Prefill is bound by arithmetic,
and a self-draft has all of the target's, so prefilling with it would cost as much as the target's own prefill.
"""
from __future__ import annotations

import torch

from lab_utils.models.kv_cache_simple import SimpleKVCache
from lab_utils.speculative.base import Proposal, Proposer

DEFAULT_DRAFT = "smollm2-draft"  # data/models/smollm2-draft
ADOPT_MIN_TOKENS = 8  # copy the target's K/V when at least this many tokens are missing (a prompt, a resume)


class _DraftState:
    def __init__(self, model, max_len: int) -> None:
        self.cache = SimpleKVCache.for_model(model, batch=1, max_len=max_len)
        self.tokens: list[int] = []  # tokens whose K/V are in the cache (first cache.length of them)


def same_weights(draft, target) -> bool:
    """Whether `draft` is the target's model (same shapes and the same weights where we look: embedding, first
    and last layer), so its K/V for a token are the target's (up to the draft's quantization)."""
    if target is None:
        return False
    fields = ("num_hidden_layers", "hidden_size", "num_key_value_heads", "head_dim", "rope_theta", "vocab_size")
    if any(getattr(draft.config, f, None) != getattr(target.config, f, None) for f in fields):
        return False

    def probes(m):
        layers = m.model.layers
        return [m.model.embed_tokens.weight, getattr(layers[0].self_attn.q_proj, "weight", None),
                getattr(layers[-1].mlp.down_proj, "weight", None)]

    for a, b in zip(probes(draft), probes(target)):
        if a is None or b is None or a.shape != b.shape or not torch.equal(a.to(b.device, b.dtype), b):
            return False
    return True


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer(Proposer):
    def __init__(self, spec_config, target_model=None, device: torch.device | str = "cpu", draft_model=None,
                 parts=None, engine_config=None) -> None:
        """`parts`: the engine's `EngineParts`; a draft quantized here (`spec_config.quantization`) uses its
        lab-05 quantizers (the learner's where written), as the engine's own quantized weights do.
        `engine_config`: the engine's, whose CPU switches the draft's fast paths follow (None: their defaults)."""
        if draft_model is None:
            from lab_utils.models.loader import load_model
            from lab_utils.models.registry import data_models

            name = spec_config.model or DEFAULT_DRAFT
            if spec_config.model is None and DEFAULT_DRAFT not in data_models():
                raise ValueError(f"SpecConfig.model is unset and the default draft data/models/{DEFAULT_DRAFT} does "
                                 f"not exist; train it (scripts/train_draft.py) or set model=<a model sharing the "
                                 f"target's tokenizer>")
            draft_model, _ = load_model(name, device=device, dtype=getattr(target_model, "dtype", None))
            self.shares_target_kv = same_weights(draft_model, target_model)  # (checked before quantizing)
            if getattr(spec_config, "quantization", None):  # our own fresh copy: quantize it in place
                from lab_utils.engine.engine import quantizers
                from lab_utils.engine.replaceable import REFERENCE
                from lab_utils.quant.linear import quantize_model

                draft_model, _ = quantize_model(draft_model, spec_config.quantization, skip=(),
                                                **quantizers(parts if parts is not None else REFERENCE))
        elif getattr(spec_config, "quantization", None):  # never quantize (change) a model the caller owns
            raise ValueError(f"SpecConfig.quantization={spec_config.quantization!r} applies to a draft loaded by "
                             f"name (SpecConfig.model); quantize the draft_model you pass yourself "
                             f"(lab_utils.quant.quantize_model) and leave quantization=None")
        else:
            self.shares_target_kv = same_weights(draft_model, target_model)
        self.num_adopted_tokens = 0  # tokens whose K/V were copied from the target instead of computed
        from lab_utils.engine.accel import fast_linears

        self.model = fast_linears(draft_model.eval(), draft_model.device, engine_config)  # packed view on a CPU (engine's GEMM)
        if target_model is not None and draft_model.config.vocab_size != target_model.config.vocab_size:
            raise ValueError(f"draft vocab_size={draft_model.config.vocab_size} differs from the target's "
                             f"{target_model.config.vocab_size}: the draft must share the target's tokenizer")
        self.states: dict[str | None, _DraftState] = {}
        self.generator = torch.Generator().manual_seed(getattr(spec_config, "seed", 0) or 0)  # draft sampling

    def _state(self, needed: int) -> _DraftState:
        st = self.states.get(self.request_id)
        ctx = self.model.config.max_position_embeddings
        if needed > ctx:
            raise ValueError(f"the draft's context ({ctx}) is shorter than the sequence ({needed} tokens)")
        if st is None or st.cache.max_len < needed:
            st = _DraftState(self.model, min(ctx, max(2 * needed, 256)))  # grow by re-prefilling (rare)
            self.states[self.request_id] = st
        return st

    @torch.inference_mode()
    def propose(self, token_ids: list[int], k: int, hidden: torch.Tensor | None = None,
                temperature: float = 0.0) -> Proposal:
        if k <= 0:
            return Proposal([])
        st = self._state(len(token_ids) + k)
        keep = min(_common_prefix(st.tokens, token_ids), len(token_ids) - 1)  # at least one token to feed
        st.cache.length, st.tokens = keep, list(token_ids[:keep])
        if self.shares_target_kv and self.target_kv is not None:
            keep = self._adopt_target_kv(st, token_ids, keep)
        feed = list(token_ids[keep:])
        out, dists = [], []
        device = st.cache.k[0].device
        for step in range(k):
            logits = st.cache.forward(self.model, torch.tensor([feed], device=device))[0, -1].float()
            st.tokens.extend(feed)
            if temperature > 0:
                q = (logits / temperature).softmax(-1).cpu()
                tok = int(torch.multinomial(q, 1, generator=self.generator))
                dists.append(q)
            else:
                tok = int(logits.argmax())
            out.append(tok)
            feed = [tok]
        return Proposal(out, torch.stack(dists) if dists else None)

    def _adopt_target_kv(self, st: _DraftState, token_ids: list[int], keep: int) -> int:
        """Copy the target's K/V for the tokens the draft is missing (up to the last one, which is fed to get
        logits) into the draft's cache, when there are enough of them to be worth it. Returns the new length."""
        n_target, read = self.target_kv
        end = min(n_target, len(token_ids) - 1)
        if end - keep < ADOPT_MIN_TOKENS:
            return keep
        for layer, (k, v) in enumerate(read(keep, end)):
            st.cache.k[layer][0, keep:end] = k
            st.cache.v[layer][0, keep:end] = v
        st.cache.length, st.tokens = end, list(token_ids[:end])
        self.num_adopted_tokens += end - keep
        return end

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)
