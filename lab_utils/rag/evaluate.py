"""Score a query strategy x retriever on a conversation file: top-k relevance (recall@k, nDCG@k against the
gold titles), constraint completeness (share of a turn's constraints that the query or state carries) and
tokens per query -- over all turns, and split into first turns and follow-ups, because follow-ups are where
the strategies differ (on a first turn all three send the same words).
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import mean

from lab_utils.rag.conversations import Conversation
from lab_utils.rag.corpus import Corpus
from lab_utils.rag.queries import Query, TokenCounter, assistant_reply, build_queries
from lab_utils.rag.session import NEGATION, SessionState, update_state


def recall_at_k(retrieved: Sequence[str], gold: Sequence[str], k: int = 5) -> float:
    """Share of the gold titles found in the top k."""
    return len(set(retrieved[:k]) & set(gold)) / len(set(gold))


def ndcg_at_k(retrieved: Sequence[str], gold: Sequence[str], k: int = 5) -> float:
    """Binary-relevance nDCG: rewards gold titles near the top; 1.0 when they fill the first ranks."""
    gold_set = set(gold)
    dcg = sum(1.0 / math.log2(r + 2) for r, t in enumerate(retrieved[:k]) if t in gold_set)
    ideal = sum(1.0 / math.log2(r + 2) for r in range(min(len(gold_set), k)))
    return dcg / ideal


def carries(text: str, constraint: str) -> bool:
    """Is the constraint present in the text? Whole words, any case; "not X" also matches "except X",
    "other than X", ... so raw messages get credit for saying it in their own words."""
    low = " ".join(text.lower().split())
    c = " ".join(constraint.lower().split())
    if c.startswith("not "):
        return re.search(rf"\b{NEGATION}\s+(?:the\s+)?{re.escape(c[4:])}\b", low) is not None
    return re.search(rf"(?<!\w){re.escape(c)}(?!\w)", low) is not None


def constraint_completeness(query: Query, constraints: Sequence[str]) -> float | None:
    """Share of constraints carried by the query (None when the turn has none: nothing to carry)."""
    if not constraints:
        return None
    carried = query.carried()
    return sum(carries(carried, c) for c in constraints) / len(constraints)


@dataclass
class TurnResult:
    conversation: str
    turn: int
    query: str
    tokens: int
    retrieved: list[str]
    gold: list[str]
    recall: float
    ndcg: float
    completeness: float | None


@dataclass
class EvalResult:
    strategy: str
    retriever: str
    k: int
    turns: list[TurnResult] = field(default_factory=list)

    def _summary(self, rows: list[TurnResult]) -> dict:
        comp = [r.completeness for r in rows if r.completeness is not None]
        k = self.k
        return {
            f"recall@{k}": round(mean(r.recall for r in rows), 4) if rows else None,
            f"ndcg@{k}": round(mean(r.ndcg for r in rows), 4) if rows else None,
            "constraint_completeness": round(mean(comp), 4) if comp else None,
            "tokens_per_query": round(mean(r.tokens for r in rows), 2) if rows else None,
            "num_turns": len(rows),
            "num_turns_with_constraints": len(comp),
        }

    def summary(self) -> dict:
        """The JSON of `rag-eval`: metrics over all turns, and the same under `first` and `followup`."""
        out = {"strategy": self.strategy, "retriever": self.retriever, "k": self.k,
               "num_conversations": len({r.conversation for r in self.turns})}
        out.update(self._summary(self.turns))
        out["first"] = self._summary([r for r in self.turns if r.turn == 0])
        out["followup"] = self._summary([r for r in self.turns if r.turn > 0])
        return out


def evaluate(
    conversations: Sequence[Conversation],
    corpus: Corpus,
    retriever,
    strategy: str,
    k: int = 5,
    retriever_name: str = "",
    count_tokens: Callable[[Sequence[str]], list[int]] | None = None,
    window: int = 2,
    update: Callable[[SessionState, str], SessionState] = update_state,
    use_replies: bool = True,
) -> EvalResult:
    """Build every turn's query, retrieve them all in one batch (dense retrievers embed faster in batches),
    and score each turn against its gold titles and constraints."""
    if k < 1:
        raise ValueError(f"k must be >= 1 (got {k})")
    count_tokens = count_tokens or TokenCounter()
    queries: list[Query] = []
    index: list[tuple[Conversation, int]] = []
    for conv in conversations:
        replies = [assistant_reply(t.gold, corpus) for t in conv.turns]
        qs = build_queries(conv.messages, strategy, replies, window=window, update=update, use_replies=use_replies)
        queries += qs
        index += [(conv, i) for i in range(len(qs))]
    retrieved = retriever.search([q.text for q in queries], k=k, exclude=[q.exclude for q in queries])
    tokens = count_tokens([q.text for q in queries])
    result = EvalResult(strategy, retriever_name or type(retriever).__name__, k)
    for (conv, i), q, hits, n in zip(index, queries, retrieved, tokens):
        turn = conv.turns[i]
        result.turns.append(TurnResult(
            conv.id, i, q.text, n, hits, list(turn.gold), recall_at_k(hits, turn.gold, k),
            ndcg_at_k(hits, turn.gold, k), constraint_completeness(q, turn.constraints),
        ))
    return result
