"""A small random Llama written to a folder, for tests whose greedy outputs must depend on the whole context.

`tiny-random` ties its embeddings and uses std 0.02, so its greedy output just repeats the last prompt token: two
implementations would agree even if one were wrong. This one has an untied lm_head, larger weights, 3 KV heads
(so 2 ranks split them 2 + 1, like SmolLM2's) and 3 layers (a 2 + 1 pipeline split), and the real vocab so the
SmolLM2 tokenizer works with it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TOY_CONFIG = dict(
    model_type="llama", vocab_size=49152, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
    num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=1024, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)


def write_toy_model(folder: str | Path, seed: int = 0, std: float = 0.15) -> Path:
    """Write config.json + model.safetensors (+ SmolLM2's tokenizer files) to `folder`; returns it."""
    from safetensors.torch import save_file

    from lab_utils.models.loader import build_random, model_folder

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = build_random(TOY_CONFIG, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight") and "layernorm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if "rotary" not in k},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(TOY_CONFIG, indent=1))
    src = model_folder("smollm2-135m")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, folder / name)
    return folder
