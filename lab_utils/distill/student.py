"""The student: a tiny Llama that shares SmolLM2's tokenizer, initialised from the teacher's embedding.

Its cost per token is dominated by the tied embedding / LM head (vocab 49152 x hidden), so the body can stay
small. head_dim 64 keeps it loadable by vLLM's CPU attention. The embedding starts as the teacher's embedding
projected on its top principal directions (PCA via the 576x576 Gram matrix): similar tokens start close, which
a random init would need many steps to learn.
"""
from __future__ import annotations

import torch

from lab_utils.models.llama import LlamaConfig, LlamaForCausalLM


def draft_config(hidden: int = 128, layers: int = 3, heads: int = 2, kv_heads: int = 1,
                 intermediate: int = 384, head_dim: int = 64, max_positions: int = 2048) -> dict:
    """An HF `LlamaForCausalLM` config dict (what `config.json` holds) for a SmolLM2-vocab student."""
    for name, v in {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
                        "intermediate": intermediate, "head_dim": head_dim}.items():
        if not (isinstance(v, int) and v >= 1):
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    if heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02, "torch_dtype": "float16",
    }


def pca_embedding(teacher_embedding: torch.Tensor, dim: int) -> torch.Tensor:
    """[V, H_t] -> [V, dim]: the rows projected on the top-`dim` eigenvectors of E^T E (uncentred, so the
    shared direction that acts like a logit bias survives), rescaled to the teacher's row RMS."""
    if not 1 <= dim <= teacher_embedding.shape[1]:
        raise ValueError(f"dim={dim} must be in [1, {teacher_embedding.shape[1]}] (the teacher's hidden size)")
    E = teacher_embedding.detach().double()
    _, vecs = torch.linalg.eigh(E.T @ E)  # ascending eigenvalues
    P = E @ vecs[:, -dim:].flip(-1)
    P = P * (E.pow(2).mean().sqrt() / P.pow(2).mean().sqrt())
    return P.float()


def init_student(config: dict, teacher=None, seed: int = 0) -> LlamaForCausalLM:
    """A student with seeded random weights (std 0.02, residual outputs scaled down by depth) and, if a teacher is
    given, the PCA-projected teacher embedding."""
    torch.manual_seed(seed)
    cfg = LlamaConfig.from_dict(config)
    model = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                std = 0.02 / (2 * cfg.num_hidden_layers) ** 0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        if teacher is not None:
            model.model.embed_tokens.weight.copy_(pca_embedding(teacher.model.embed_tokens.weight, cfg.hidden_size))
    return model


def num_params(model) -> int:
    """Unique parameters (the tied LM head counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
