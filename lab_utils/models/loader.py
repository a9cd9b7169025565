"""`load_model(name_or_path)`: our Llama implementation with weights from an HF safetensors folder."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from lab_utils.device import default_dtype, resolve_device
from lab_utils.models.llama import LlamaConfig, LlamaForCausalLM
from lab_utils.models.registry import REGISTRY, ModelSpec, lookup, prepared_dir
from lab_utils.models.tokenizer import load_tokenizer

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "smollm", "smollm2")


def load_config(folder: Path) -> LlamaConfig:
    raw = json.loads((folder / "config.json").read_text())
    mtype = raw.get("model_type", "llama")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{folder}: model_type {mtype!r} is not Llama-family (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return LlamaConfig.from_dict(raw)


def load_weights(model: LlamaForCausalLM, folder: Path) -> None:
    """Load every *.safetensors shard; safetensors only (never pickle), strict about missing weights."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weights (convert .bin checkpoints to safetensors first)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and model.config.tie_word_embeddings)]
    unexpected = [u for u in unexpected if "rotary_emb" not in u]
    if missing or unexpected:
        raise ValueError(f"{folder}: weights do not match the config (missing {missing[:5]}, unexpected {unexpected[:5]})")


def build_random(config: dict, seed: int = 0, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """A model of a real shape with random weights (std 0.02, like HF's init), reproducible by seed, in fp32.

    Drawn on a GPU whenever the machine has one, whatever `device` the model runs on, then moved there: CPU and
    CUDA generators give different numbers for one seed, and a lab compares engines in different processes and
    on different devices (lab 09's ranks, lab 10's and lab 14's workers run on the CPU beside a notebook engine on
    the GPU), so every process of a machine must draw the same weights. A GPU draws in milliseconds; a CPU's
    generator is serial (the 1B shape takes ~1 min on 2 threads), so a machine without a GPU draws on the CPU.
    The parameters are allocated on the drawing device (meta -> `to_empty`) and drawn in a fixed order."""
    from lab_utils.models.llama import rope_inv_freq

    cfg = LlamaConfig.from_dict(config)
    dev = torch.device(device)
    draw = dev if dev.type == "cuda" else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=draw)
    if cfg.tie_word_embeddings:  # to_empty may give each module its own new tensor: tie again before drawing
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator(device=draw).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model = model.to(dev)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(dev)
    return model


def model_folder(name_or_path: str) -> Path:
    """The HF folder behind a name (preparing SmolLM2 on first use), or the path itself."""
    spec, folder = lookup(name_or_path)
    if spec is not None and spec.kind == "prepared":
        from lab_utils.models.prepare import is_prepared, prepare_smollm2

        if not is_prepared(folder):
            prepare_smollm2()
    if folder is None:
        raise ValueError(f"{name_or_path!r} is a random-weight model and has no folder")
    return folder


def tokenizer_folder(name_or_path: str) -> Path:
    """The folder of a model's tokenizer: a random-weight model's is its `tokenizer_from` (it has no folder of
    its own), any other model's is its own folder."""
    spec, _ = lookup(str(name_or_path))
    if spec is not None and spec.kind == "random":
        return model_folder(spec.tokenizer_from)
    return model_folder(name_or_path)


def load_model(
    name_or_path: str = "smollm2-135m",
    device: str | torch.device = "auto",
    dtype: torch.dtype | None = None,
    seed: int = 0,
):
    """Return (model, tokenizer). `device="auto"` picks CUDA when present; dtype defaults to fp32 on CPU, bf16 on GPU."""
    dev = resolve_device(device)
    dtype = dtype or default_dtype(dev)
    spec, _ = lookup(str(name_or_path))
    if spec is not None and spec.kind == "random":
        model = build_random(spec.config, seed=seed, device=dev)
        tokenizer = load_tokenizer(model_folder(spec.tokenizer_from))
    else:
        folder = model_folder(str(name_or_path))
        with torch.device("meta"):
            model = LlamaForCausalLM(load_config(folder))
        model = model.to_empty(device="cpu")
        model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.new_empty(0)  # recomputed below
        load_weights(model, folder)
        from lab_utils.models.llama import rope_inv_freq

        c = model.config
        model.model.rotary_emb.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        if c.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        tokenizer = load_tokenizer(folder)
    model = model.to(device=dev, dtype=dtype).eval()
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.float()  # keep RoPE frequencies in fp32
    model.name = str(name_or_path)
    return model, tokenizer
