"""Tokenizers come from the model folder (`tokenizer.json` via `transformers`), never from a hub."""
from __future__ import annotations

from pathlib import Path


def load_tokenizer(folder: str | Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def chat_prompt(tokenizer, user: str, system: str | None = None) -> str:
    """Apply the model's chat template to one user message (generation prompt appended)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
