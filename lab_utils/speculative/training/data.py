"""Building blocks of the heads' training data (the corpus itself: `heads_corpus.py`).

Why the target's own text matters: speculation is judged on what the TARGET generates, so every label is the
target's greedy token at that position (`greedy[t] = argmax lm_head(hidden[t])`) and heads learn to imitate the
target, not the corpus. Here: prompt templates, the `Sequence` record (tokens + the target's final-norm hidden
states + its greedy tokens), batched greedy generation that captures the hidden states as it goes, prefill-only
features of fixed text, the validation split and where each answer starts (only generated positions are scored).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


CHAT_TEMPLATES = (
    "Tell me about {title}.",
    "What is {title}? Answer in two sentences.",
    "Write a short paragraph about {title}.",
    "Explain {title} to a ten-year-old.",
    "Give three facts about {title}.",
)
CONTEXT_TEMPLATE = "Answer from this context.\n\nContext: {extract}\n\nQuestion: What is {title}?"
GENERIC_PROMPTS = (
    "Write a haiku about the sea.", "What is the boiling point of water?", "Name three prime numbers.",
    "Write a short story about a robot who learns to paint.", "How do I make a cup of tea?",
    "Explain what a neural network is.", "List five fruits and their colours.", "What causes rain?",
    "Write a polite email asking for a meeting next week.", "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.", "Give me tips for learning a new language.",
)


CODE_TRAIN = (
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "def is_palindrome(s):\n    s = ''.join(c.lower() for c in s if c.isalnum())\n    return s == s[::-1]",
    ("def flatten(items):\n    out = []\n    for x in items:\n        if isinstance(x, list):\n"
     "            out.extend(flatten(x))\n        else:\n            out.append(x)\n    return out"),
    "def chunks(xs, size):\n    return [xs[i:i + size] for i in range(0, len(xs), size)]",
    "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a",
    "def to_celsius(f):\n    return (f - 32) * 5 / 9",
    ("def count_vowels(text):\n    total = 0\n    for ch in text.lower():\n        if ch in 'aeiou':\n"
     "            total += 1\n    return total"),
    ("def dedupe(xs):\n    seen = set()\n    out = []\n    for x in xs:\n        if x not in seen:\n"
     "            seen.add(x)\n            out.append(x)\n    return out"),
)
CODE_EDITS = ("Add a docstring to this function.", "Rename the variables to longer names.",
              "Add type hints.", "Rewrite it with a comment on each line.")
QUOTE_TEMPLATES = ("Repeat this passage exactly:\n\n{p}", "Copy the following lines word for word.\n\n{p}",
                   "Here is a passage:\n\n{p}\n\nWrite it out again.")


@dataclass
class Sequence:
    """One token sequence with the target's final-norm hidden states and greedy next-token at each position."""

    ids: torch.Tensor       # [T] int64
    hidden: torch.Tensor    # [T, H] fp16 (the target's final-norm hidden state at each position)
    greedy: torch.Tensor    # [T] int64: argmax of the target's logits at each position (its next token)
    source: str             # "chat", "play", "wiki", "shakespeare"


def _chat(tokenizer, text: str) -> list[int]:
    s = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(s, add_special_tokens=False)


class _PaddedCache:
    """A growing KV cache for a LEFT-padded batch: keys of padding are masked, every row attends causally."""

    def __init__(self, valid: torch.Tensor) -> None:
        self.valid = valid                      # [B, P] bool: real prompt tokens (False = left padding)
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer_idx in self.k:
            k = self.k[layer_idx] = torch.cat([self.k[layer_idx], k], dim=1)
            v = self.v[layer_idx] = torch.cat([self.v[layer_idx], v], dim=1)
        else:
            self.k[layer_idx], self.v[layer_idx] = k, v
        B, Tq, Tk = q.shape[0], q.shape[1], k.shape[1]
        valid = torch.cat([self.valid, self.valid.new_ones(B, Tk - self.valid.shape[1])], dim=1)
        qi = torch.arange(Tk - Tq, Tk, device=q.device)
        causal = qi[:, None] >= torch.arange(Tk, device=q.device)[None, :]
        mask = (causal[None] & valid[:, None, :]).unsqueeze(1)            # [B, 1, Tq, Tk]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2)


@torch.no_grad()
def generate_with_features(model, prompts: list[list[int]], max_new_tokens: int, eos: set[int] | None = None,
                           batch: int = 32) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Greedy continuations AND the target's hidden state + greedy token at every position, in one pass.

    Returns (ids, hidden [T, H] fp16, greedy [T]) per prompt, where ids = prompt + continuation (cut after an
    EOS, and without the final token whose hidden state was never computed). Capturing the states while
    generating avoids a second forward over every sequence (half the cost on a CPU)."""
    eos = eos or set()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    res: list = [None] * len(prompts)
    for g0 in range(0, len(order), batch):
        group = order[g0: g0 + batch]
        P = max(len(prompts[i]) for i in group)
        ids = torch.zeros(len(group), P, dtype=torch.long)
        valid = torch.zeros(len(group), P, dtype=torch.bool)
        for r, i in enumerate(group):
            n = len(prompts[i])
            ids[r, P - n:] = torch.tensor(prompts[i])
            valid[r, P - n:] = True
        pos = (valid.long().cumsum(1) - 1).clamp(min=0)
        cache = _PaddedCache(valid.to(model.device))
        h = model.hidden_states(ids.to(model.device), pos.to(model.device), cache)
        logits = model.logits(h)
        hs, gs, toks = [h], [logits.argmax(-1)], []
        nxt, cur = gs[0][:, -1], pos[:, -1].to(model.device)
        for _ in range(max_new_tokens - 1):
            toks.append(nxt)
            cur = cur + 1
            h = model.hidden_states(nxt[:, None], cur[:, None], cache)
            g = model.logits(h).argmax(-1)
            hs.append(h)
            gs.append(g)
            nxt = g[:, -1]
        H = torch.cat(hs, dim=1).to("cpu", torch.float16)
        G = torch.cat(gs, dim=1).cpu()
        gen = torch.stack(toks, dim=1).cpu() if toks else torch.zeros(len(group), 0, dtype=torch.long)
        for r, i in enumerate(group):
            n, out = len(prompts[i]), gen[r].tolist()
            for j, t in enumerate(out):
                if t in eos:
                    out = out[: j + 1]
                    break
            T = n + len(out)
            res[i] = (list(prompts[i]) + out, H[r, P - n: P - n + T].clone(), G[r, P - n: P - n + T].clone())
    return res


@torch.no_grad()
def target_features(model, seqs: list[list[int]], batch_tokens: int = 2048) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(hidden [T, H] fp16, greedy [T]) for each sequence: right-padded batches (causal, so padding is harmless)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    res: list = [None] * len(seqs)
    i = 0
    while i < len(order):
        T = len(seqs[order[i]])
        j = i
        while j < len(order) and (j - i + 1) * len(seqs[order[j]]) <= max(batch_tokens, T):
            j += 1
        group = order[i:j]
        T = max(len(seqs[g]) for g in group)
        ids = torch.zeros(len(group), T, dtype=torch.long)
        for r, g in enumerate(group):
            ids[r, : len(seqs[g])] = torch.tensor(seqs[g])
        h = model.hidden_states(ids.to(model.device))
        greedy = model.logits(h).argmax(-1)
        for r, g in enumerate(group):
            n = len(seqs[g])
            res[g] = (h[r, :n].to("cpu", torch.float16), greedy[r, :n].cpu())
        i = j
    return res


def _eos(tokenizer) -> set[int]:
    return {tokenizer.eos_token_id} | set(tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))


def split_validation(seqs: list[Sequence], every: int = 10) -> tuple[list[Sequence], list[Sequence]]:
    """(train, validation): every `every`-th generated sequence is kept for early stopping (the held-out split
    stays untouched for the reported figures)."""
    gen = [i for i, s in enumerate(seqs) if s.source in ("chat", "play", "task")]
    val_idx = set(gen[::every])
    return [s for i, s in enumerate(seqs) if i not in val_idx], [seqs[i] for i in sorted(val_idx)]


def generation_starts(seqs: list[Sequence], tokenizer, play_prompt_len: int = 64) -> list[int]:
    """First generated position of each sequence (after the chat template's assistant header; after the
    64-token excerpt for play prompts); len(ids) for plain text, which has no generated part."""
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    out = []
    for s in seqs:
        ids = s.ids.tolist()
        if s.source in ("chat", "task") and im_start in ids:
            i = len(ids) - ids[::-1].index(im_start) - 1        # the last turn's header: <|im_start|> ass istant \n
            while i < len(ids) and "\n" not in tokenizer.decode([ids[i]]):
                i += 1
            out.append(min(i + 1, len(ids)))
        elif s.source == "play":
            out.append(play_prompt_len)
        else:
            out.append(len(ids))
    return out


def num_tokens(seqs: list[Sequence]) -> int:
    return sum(len(s.ids) for s in seqs)


@dataclass
class HeadsData:
    """Everything a heads training script needs: the frozen target, its features, the splits."""

    target: torch.nn.Module
    tokenizer: object
    data: dict[str, list[Sequence]]
    train: list[Sequence]
    val: list[Sequence]
    heldout_starts: list[int]  # where each held-out sequence's generated answer begins (scored positions)

    def summary(self) -> dict:
        """The `data` block of a training result (what the model cards quote)."""
        return {"train_sequences": len(self.data["train"]), "train_tokens": num_tokens(self.data["train"]),
                "heldout_tokens": num_tokens(self.data["heldout"]),
                "sources": sorted({s.source for s in self.data["train"]})}


