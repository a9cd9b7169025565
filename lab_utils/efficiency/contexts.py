"""Shorter contexts: four ways to send a conversation's turn to the model, and what each costs and keeps.

- `full`: every earlier turn (user message and reply), then the new message.
- `last`: the last N earlier turns only, then the new message.
- `session`: lab 11's session state (`lab_utils.rag.session.run_session`: the entities in focus, the constraints
  in force, the goal) in the system message, then the new message.
- `compressed`: the full history with its least surprising words dropped until a token budget is met, scored by
  the target itself (LLMLingua's idea without extra weights): one prefill of the full context with prompt
  log-probabilities gives each token's surprisal, a word's score is the mean surprisal of its tokens. That
  scoring pass is a full prefill by the target: it is a cost of this variant, counted beside its prompt.

A prompt is built as pieces in the model's chat template: template pieces (`<|im_start|>user\\n`, `<|im_end|>\\n`),
the system message and the latest user message (kept whole: the instructions and the question, as LLMLingua
keeps them), and whole words of the history in between (each with its leading space). Only history words can be
dropped: a compressor that cuts a word in two or drops a template token or the question sends the model text it
never saw in training (`whole_words_only` checks a compressed prompt against its pieces).

Answer quality, where the conversations have no answer key: agreement with the target's own greedy answer under
the full history. One teacher-forced pass per variant (its prompt, then that reference answer) tells at each
answer position whether the target's most likely next token is the reference's: a variant keeps the answer when
all of the first K positions agree (the target would greedily write the same first K tokens).
"""
from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from lab_utils.engine.sampling_params import SamplingParams

TIE = 1e-3  # nats: a reference token this close to the most likely one agrees (another order of the same sums)


@dataclass(frozen=True)
class Piece:
    """A run of prompt tokens: "template" (chat-template markers), "kept" (the system message, the latest user
    message) or "word" (a history word: the only kind a compressor may drop)."""
    ids: tuple[int, ...]
    kind: str


@dataclass(frozen=True)
class Context:
    """A prompt as its pieces, in order (`ids` joins them)."""
    pieces: tuple[Piece, ...]

    @property
    def ids(self) -> list[int]:
        return [i for p in self.pieces for i in p.ids]

    def __len__(self) -> int:
        return sum(len(p.ids) for p in self.pieces)

    def keep(self, mask: Sequence[bool]) -> Context:
        """The pieces where `mask` is true; every piece that is not a history word is kept whatever the mask."""
        return Context(tuple(p for p, k in zip(self.pieces, mask) if k or p.kind != "word"))


def words(text: str) -> list[str]:
    """Whitespace-led words: "Tell me about Curie." -> ["Tell", " me", " about", " Curie."] (joined: the text)."""
    return re.findall(r"\s*\S+\s*$|\s*\S+", text) or ([text] if text else [])


def chat_context(tokenizer, messages: Sequence[tuple[str, str]]) -> Context:
    """(role, content) messages in SmolLM2's chat template (ChatML), ending with the assistant's turn opened. The
    system message and the last one (the latest user turn) are kept whole; the others are split into words."""
    enc = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    pieces = []
    for i, (role, content) in enumerate(messages):
        pieces.append(Piece(enc(f"<|im_start|>{role}\n"), "template"))
        if role == "system" or i == len(messages) - 1:
            pieces.append(Piece(enc(content), "kept"))
        else:
            pieces.extend(Piece(enc(w), "word") for w in words(content))
        pieces.append(Piece(enc("<|im_end|>\n"), "template"))
    pieces.append(Piece(enc("<|im_start|>assistant\n"), "template"))
    return Context(tuple(p for p in pieces if p.ids))


def reply(turn, corpus, chars: int = 300) -> str:
    """A stand-in for the assistant's answer to a turn: the extract of its gold articles (as lab 14's histories)."""
    return " ".join(corpus[g].extract for g in turn.gold if g in corpus)[:chars]


def variants(tokenizer, system: str, conversation, corpus, i: int, last_n: int = 1) -> dict[str, Context]:
    """Turn `i` of a lab 11 conversation as "full", "last" (the last `last_n` earlier turns) and "session" (lab
    11's session state after the earlier turns and their replies, then the new message) contexts."""
    from lab_utils.rag.session import run_session

    turns = conversation.turns
    pairs = [(t.user, reply(t, corpus)) for t in turns[:i]]
    asked = ("user", turns[i].user)
    chat = lambda history: [("system", system)] + [m for u, a in history  # noqa: E731
                                                   for m in (("user", u), ("assistant", a))] + [asked]
    state = run_session([t.user for t in turns[:i + 1]], replies=[a for _, a in pairs])[-1]
    return {"full": chat_context(tokenizer, chat(pairs)),
            "last": chat_context(tokenizer, chat(pairs[max(0, i - last_n):])),
            "session": chat_context(tokenizer, [("system", f"{system}\nThe conversation so far: {state.render()}"),
                                                asked])}


def surprisals(engine, ids: Sequence[int]) -> list[float]:
    """Each prompt token's surprisal (-log p of the token after those before it) under `engine`'s model: one prefill
    asking for prompt log-probabilities. Token 0 has none: 0.0."""
    out = engine.generate([list(ids)], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return [0.0] + [-lp.logprob for lp in out.prompt_logprobs[1:]]


def word_scores(context: Context, surprisal: Sequence[float]) -> list[float]:
    """Each piece's mean token surprisal (a word is as surprising as its tokens are on average)."""
    out, k = [], 0
    for p in context.pieces:
        out.append(sum(surprisal[k:k + len(p.ids)]) / len(p.ids))
        k += len(p.ids)
    return out


def drop_to_budget(context: Context, order: Sequence[int], budget: int) -> Context:
    """Drop history words in `order` (piece indices) until the context fits `budget` tokens (or none is left)."""
    mask, size = [True] * len(context.pieces), len(context)
    for i in order:
        if size <= budget:
            break
        if context.pieces[i].kind == "word":
            mask[i] = False
            size -= len(context.pieces[i].ids)
    return context.keep(mask)


def compress(context: Context, surprisal: Sequence[float], budget: int) -> Context:
    """LLMLingua's idea at word level: drop the least surprising history words first until `budget` is met."""
    scores = word_scores(context, surprisal)
    return drop_to_budget(context, sorted(range(len(scores)), key=scores.__getitem__), budget)


def random_drop(context: Context, budget: int, rng: random.Random) -> Context:
    """The control: history words dropped in random order to the same budget."""
    order = list(range(len(context.pieces)))
    rng.shuffle(order)
    return drop_to_budget(context, order, budget)


def whole_words_only(context: Context, ids: Sequence[int]) -> bool:
    """Whether `ids` is `context` with some history words dropped whole: every template piece, the system message
    and the latest user message present, in order, and nothing else (no word cut in two, no token from elsewhere)."""
    ids, pieces = list(ids), context.pieces
    reach = {0}  # prompt positions a parse of the pieces so far can end at
    for p in pieces:
        n = len(p.ids)
        nxt = {k + n for k in reach if ids[k:k + n] == list(p.ids)}
        reach = nxt if p.kind != "word" else reach | nxt
        if not reach:
            return False
    return len(ids) in reach


def agreement(engine, prompt: Sequence[int], answer: Sequence[int]) -> tuple[int, float]:
    """Teacher-forced: `prompt` then the reference `answer`; how many leading answer tokens are the target's most
    likely next token (within TIE), and the answer's mean log-probability per token."""
    out = engine.generate([list(prompt) + list(answer)], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    entries = out.prompt_logprobs[len(prompt):]
    agreed = 0
    for e in entries:
        if e.top and e.top[0][1] - e.logprob > TIE:
            break
        agreed += 1
    return agreed, sum(e.logprob for e in entries) / max(len(entries), 1)


def quality(engine, turns: Sequence[Mapping[str, Context]], k: int) -> dict[str, list[tuple[int, float]]]:
    """Per variant, per turn: (leading tokens of the reference answer the target agrees with, capped at `k`; the
    reference's mean log-probability), the reference being the target's greedy `k`-token answer under "full"."""
    out: dict[str, list[tuple[int, float]]] = {name: [] for name in turns[0]}
    for contexts in turns:
        answer = engine.generate([contexts["full"].ids], SamplingParams(max_tokens=k))[0].token_ids[:k]
        for name, context in contexts.items():
            agreed, logprob = agreement(engine, context.ids, answer)
            out[name].append((min(agreed, k), logprob))
    return out


def summary(turns: Sequence[Mapping[str, Context]], scores: Mapping[str, list[tuple[int, float]]], k: int,
            budgets: Sequence[int], times: Mapping[str, list[float]], scoring_tokens: int) -> dict:
    """What lab 15's context claims read: per variant its prompt tokens (all turns), answers kept (all `k` leading
    tokens agree) and mean agreed tokens; the compressor's budgets, whole-word verdict and scoring tokens; the
    per-round first-token times."""
    n = len(turns)
    return {"turns": n, "k": k, "budgets": list(budgets), "scoring_tokens": scoring_tokens,
            "tokens": {v: sum(len(t[v]) for t in turns) for v in turns[0]},
            "compressed_sizes": [len(t["compressed"]) for t in turns],
            "whole_words": sum(whole_words_only(t["full"], t["compressed"].ids) for t in turns),
            "kept": {v: sum(a >= k for a, _ in s) / n for v, s in scores.items()},
            "agreed_tokens": {v: sum(a for a, _ in s) / n for v, s in scores.items()},
            "logprob": {v: sum(lp for _, lp in s) / n for v, s in scores.items()},
            "ttft_s": {v: list(ts) for v, ts in times.items()}}


def first_token_times(engine, prompts: Mapping[str, Sequence[Sequence[int]]], rounds: int,
                      before: Mapping[str, Callable[[int], float]] | None = None) -> dict[str, list[float]]:
    """Per variant, per round, the sum over its prompts of each one's time to first token, each prompt alone
    through `engine` (build it with the prefix cache off, so every round prefills in full), variants interleaved
    in rounds after one untimed warm-up. `before[v](j)` does the work variant v does before its prompt j is sent
    (the compressor's scoring pass) and returns its seconds, added to that prompt's time."""
    from lab_utils.bench.rounds import interleave

    once = SamplingParams(max_tokens=1)
    before = before or {}

    def serve(name: str) -> float:
        total = 0.0
        for j, p in enumerate(prompts[name]):
            extra = before[name](j) if name in before else 0.0
            total += extra + engine.generate([list(p)], once)[0].metrics.ttft
        return total

    for name in prompts:
        engine.generate([list(prompts[name][0])], once)  # one-off costs (allocations, kernel choices)
    return interleave({name: (lambda name=name: serve(name)) for name in prompts}, rounds)


def timed(fn: Callable[[], object]) -> float:
    """Seconds `fn()` took."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
