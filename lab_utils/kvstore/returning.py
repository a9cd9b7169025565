"""Returning conversations as an engine trace: where each turn's prompt came from (device, host tier, recomputed).

Lab 11's conversations become chat prompts (a system prompt, then each earlier turn's user message and a reply,
then the new message). Token ids are built segment by segment, so a turn's history is exactly a prefix of the
next turn's prompt (a tokenizer may merge text across a boundary; ids joined per segment cannot). The turns run
round-robin over the conversations, one request at a time: by the time a conversation comes back, the others
have pushed its blocks out of a small device pool, and only the host tier (if any) still holds them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


SYSTEM = "You are a helpful assistant. Answer the user's question in a few sentences."


@dataclass(frozen=True)
class TraceTurn:
    conversation: str
    turn: int
    prompt: tuple[int, ...]


@dataclass
class TurnRow:
    """One turn as it ran: prompt tokens by where they came from, its time to first token, its output."""
    conversation: str
    turn: int
    prompt_tokens: int
    device_tokens: int  # served by blocks still on the device
    host_tokens: int  # served by blocks copied back from the host tier
    computed_tokens: int  # prefilled
    host_blocks_in: int
    ttft_s: float
    token_ids: list[int] = field(default_factory=list)


def chat_prompts(conversations, corpus, tokenizer, num_conversations: int, num_turns: int,
                 passage_chars: int = 800, reply_chars: int = 300) -> list[list[tuple[int, ...]]]:
    """Per conversation (those with at least `num_turns` turns, the first `num_conversations`), the prompt ids of
    each of its first `num_turns` turns: the system prompt (shared by all), the passages retrieved for the
    conversation's topic (its first turn's gold articles), then the turns. The reply to a turn is the lead of
    its gold articles, as lab 11 uses."""
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    out = []
    for convo in [c for c in conversations if len(c.turns) >= num_turns][:num_conversations]:
        passages = " ".join(corpus[g].text for g in convo.turns[0].gold if g in corpus)[:passage_chars]
        history, prompts = list(enc(SYSTEM)) + enc(f"\n\nPassages: {passages}"), []
        for turn in convo.turns[:num_turns]:
            ask = enc(f"\n\nUser: {turn.user}")
            prompts.append(tuple(history + ask + enc("\n\nAssistant:")))
            reply = " ".join(corpus[g].extract for g in turn.gold if g in corpus)[:reply_chars]
            history += ask + enc(f"\n\nAssistant: {reply}")
        out.append(prompts)
    return out


def round_robin(conversations: Sequence[str], prompts: Sequence[Sequence[tuple[int, ...]]],
                one_offs: Sequence[tuple[int, ...]] = ()) -> list[TraceTurn]:
    """Every conversation's first turn, then every second turn, ...: each returns after all the others ran.
    `one_offs` (single questions that never return, as turn 0 of conversations "one-off <i>") are spread evenly
    between the turns."""
    turns = [TraceTurn(cid, t, ps[t]) for t in range(max(map(len, prompts)))
             for cid, ps in zip(conversations, prompts) if t < len(ps)]
    out, k = [], 0
    for i, turn in enumerate(turns, start=1):
        out.append(turn)
        while k < len(one_offs) and k * len(turns) < i * len(one_offs):
            out.append(TraceTurn(f"one-off {k}", 0, one_offs[k]))
            k += 1
    return out


def run_trace(engine, trace: Sequence[TraceTurn], params) -> list[TurnRow]:
    """Each turn alone through `engine` (so its TTFT is its own prefill, plus any copy back)."""
    bm = engine.block_manager
    tier = bm.host_tier
    rows = []
    for t in trace:
        hits_before = tier.hits if tier is not None else 0
        out = engine.generate([list(t.prompt)], params)[0]
        host_blocks = (tier.hits - hits_before) if tier is not None else 0
        host = min(host_blocks * bm.block_size, out.num_cached_tokens)
        rows.append(TurnRow(t.conversation, t.turn, len(t.prompt), out.num_cached_tokens - host, host,
                            len(t.prompt) - out.num_cached_tokens, host_blocks, out.metrics.ttft, list(out.token_ids)))
    return rows


def leak_report(engine) -> str:
    """'' when no block leaked: the device pool all free (every reference returned) and the tier's books right
    (its bytes the sum of its entries, within capacity, and its policy tracking exactly its entries)."""
    try:
        engine.block_manager.check_all_free()
    except AssertionError as err:
        return f"device: {err}"
    tier = engine.block_manager.host_tier
    return tier.books() if tier is not None else ""  # a shared store keeps its books in its own process


def returning(rows: Sequence[TurnRow]) -> list[TurnRow]:
    """The turns after a conversation's first: the ones whose history could come from a cache."""
    return [r for r in rows if r.turn > 0]
