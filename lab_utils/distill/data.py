"""The distillation corpus, offline: prompts from Wikipedia summaries and Shakespeare, split by source item.

Speculative decoding runs the draft on text the *target* writes, so the draft is trained mostly on the
teacher's own greedy continuations of prompts like the labs' (sequence-level KD): chat questions about
Wikipedia topics, the opening words of a Wikipedia summary, and a few lines of a play. Held-out prompts come
from articles and plays never used for training, so agreement measured on them is honest.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from lab_utils.bench.workload import HELDOUT_PLAYS  # never trained on

QUESTION_TEMPLATES = (
    "Tell me about {t}.",
    "What is {t}?",
    "Explain {t} in simple terms.",
    "Write a short paragraph about {t}.",
    "Give me three facts about {t}.",
    "Why is {t} important?",
)


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    source: str  # "chat", "wiki", "play", "quote"
    text: str


def is_heldout(key: str, frac: float = 0.1) -> bool:
    """A stable split by item (article title or play): the same item is always on the same side."""
    h = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < frac


def _plays(heldout: bool) -> list[tuple[str, str]]:
    from lab_utils.bench.workload import shakespeare_texts

    out = [(name, text) for name, text in shakespeare_texts() if (name in HELDOUT_PLAYS) == heldout]
    if not out:
        raise RuntimeError(f"no {'held-out' if heldout else 'training'} plays found (held out: {HELDOUT_PLAYS})")
    return out


def _docs(heldout: bool):
    from lab_utils.rag.corpus import load_corpus

    return [d for d in load_corpus() if is_heldout(d.title) == heldout]


QUOTE_INSTRUCTION = "Repeat the following passage exactly, word for word:\n\n{passage}"  # lab 07's quote workload


def make_prompts(tokenizer, n: int, split: str = "train", seed: int = 0,
                 mix: tuple[float, ...] = (0.5, 0.3, 0.2)) -> list[Prompt]:
    """`n` prompts of the given split, `mix` = shares of (chat, wiki, play[, quote]). Seeded, so reruns agree.

    "quote" asks (in the chat template) to repeat a ~120-token passage of a play of the split word for word:
    the teacher's answer copies its prompt, which teaches a draft to copy (lab 07's quote workload uses the
    held-out plays only)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split={split!r} is invalid: use 'train' or 'heldout'")
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    from lab_utils.models.tokenizer import chat_prompt

    rng = random.Random(f"{seed}-{split}")
    held = split == "heldout"
    docs, plays = _docs(held), _plays(held)
    if len(mix) not in (3, 4) or min(mix) < 0 or sum(mix) <= 0:
        raise ValueError(f"mix={mix} is invalid: give 3 or 4 non-negative shares (chat, wiki, play[, quote])")
    counts = [round(n * s / sum(mix)) for s in mix] + [0] * (4 - len(mix))
    counts[counts.index(max(counts))] += n - sum(counts)
    out: list[Prompt] = []
    for _ in range(counts[0]):
        d = rng.choice(docs)
        q = rng.choice(QUESTION_TEMPLATES).format(t=d.title)
        text = chat_prompt(tokenizer, q)
        out.append(Prompt(tuple(tokenizer(text, add_special_tokens=False).input_ids), "chat", text))
    for _ in range(counts[1]):
        d = rng.choice(docs)
        ids = tokenizer(d.extract, add_special_tokens=False).input_ids[: rng.randint(8, 24)]
        out.append(Prompt(tuple(ids), "wiki", tokenizer.decode(ids)))
    for _ in range(counts[2]):
        _name, text = rng.choice(plays)
        start = text.find("\n", rng.randrange(len(text) - 2000)) + 1
        ids = tokenizer(text[start:start + 400], add_special_tokens=False).input_ids[:24]
        out.append(Prompt(tuple(ids), "play", tokenizer.decode(ids)))
    for _ in range(counts[3]):
        _name, text = rng.choice(plays)
        start = text.find("\n", rng.randrange(len(text) - 2000)) + 1
        passage = tokenizer.decode(tokenizer(text[start:start + 1000], add_special_tokens=False).input_ids[:120])
        chat = chat_prompt(tokenizer, QUOTE_INSTRUCTION.format(passage=passage))
        out.append(Prompt(tuple(tokenizer(chat, add_special_tokens=False).input_ids), "quote", chat))
    rng.shuffle(out)
    return out


def heldout_texts(tokenizer, n: int = 32, length: int = 64, seed: int = 0) -> list[list[int]]:
    """`n` held-out raw-text windows of `length` tokens (half Wikipedia, half Shakespeare): perplexity probes."""
    rng = random.Random(f"{seed}-texts")
    docs, plays = _docs(True), _plays(True)
    out: list[list[int]] = []
    while len(out) < n:
        if len(out) % 2 == 0:
            ids = tokenizer(rng.choice(docs).extract, add_special_tokens=False).input_ids
            if len(ids) < length:
                continue
        else:
            _name, text = rng.choice(plays)
            start = text.find("\n", rng.randrange(len(text) - 4000)) + 1
            ids = tokenizer(text[start:start + length * 8], add_special_tokens=False).input_ids
        out.append(ids[:length])
    return out


def raw_records(tokenizer, n: int, top_k: int, length: int = 96, seed: int = 0) -> list[dict]:
    """`n` training-split plain-text windows (3/4 Wikipedia, 1/4 Shakespeare) in the teacher-record format with
    one-hot targets (the true next token), so the KD loss on them is plain cross-entropy: cheap extra text."""
    import torch

    rng = random.Random(f"{seed}-raw")
    docs, plays = _docs(False), _plays(False)
    out: list[dict] = []
    while len(out) < n:
        if len(out) % 4:
            ids = tokenizer(rng.choice(docs).extract, add_special_tokens=False).input_ids[:length]
        else:
            _name, text = rng.choice(plays)
            start = text.find("\n", rng.randrange(len(text) - 4000)) + 1
            ids = tokenizer(text[start:start + length * 8], add_special_tokens=False).input_ids[:length]
        if len(ids) < 16:
            continue
        t = torch.tensor(ids, dtype=torch.int32)
        idx = torch.zeros(len(ids) - 1, top_k, dtype=torch.int32)
        idx[:, 0] = t[1:]
        val = torch.full((len(ids) - 1, top_k), -1e4, dtype=torch.float16)
        val[:, 0] = 0.0
        out.append({"ids": t, "topk_idx": idx, "topk_val": val, "n_prompt": 1})
    return out
