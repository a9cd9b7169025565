"""Three ways to turn a conversation into a retrieval query, and what each costs in tokens.

- `last`: the latest user message only. Cheap; blind to "she", "it", "what about ...".
- `full`: the whole history, user and assistant turns, concatenated. Complete, but long, and old topics
  outweigh the new question.
- `session`: the session state (entities, constraints, goal) + the last `window` raw user messages. The
  state also notes the subject of each assistant reply (`use_replies`), since users point at what the
  assistant said ("what other drink contains it?") as often as at what they said themselves.

Our conversation files hold only user turns, so `full` stands in for a chat history by giving each earlier
turn the reply of an assistant that answered it correctly: the lead sentence of each gold article. That is
the text a real history would carry, and it is what makes re-sending the history expensive.

Tokens are counted with SmolLM2's tokenizer: the model a query rewriter or the answering model would run.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lab_utils.rag.corpus import Corpus
from lab_utils.rag.session import SessionState, run_session, update_state

STRATEGIES = ("last", "full", "session")


@dataclass(frozen=True)
class Query:
    text: str                        # what the retriever sees (and what the tokens are counted on)
    exclude: tuple[str, ...] = ()    # titles containing these are filtered out ("not X" constraints)
    state: SessionState | None = None

    def carried(self) -> str:
        """Everything the query hands downstream: its text plus, for `session`, the state's constraints."""
        if self.state is None:
            return self.text
        return " ".join([self.text, *self.state.constraints])


def assistant_reply(gold: Sequence[str], corpus: Corpus) -> str:
    """A stand-in for the assistant's answer to a turn: the lead sentence of each gold article."""
    return " ".join(corpus[t].lead() for t in gold if t in corpus)


def session_text(state: SessionState, messages: Sequence[str]) -> str:
    """State first (entities, positive constraints, goal), then the raw messages, as plain words: labels
    such as "entities:" would cost tokens and match documents that happen to contain them."""
    named = " ".join([*state.entities, *state.positive_constraints()])
    seen = set(named.lower().split())
    goal = " ".join(w for w in state.goal.split() if w not in seen)  # say each fact once: repeats skew BM25
    return " ".join(p for p in [named, goal, *messages] if p)


def build_queries(
    messages: Sequence[str],
    strategy: str,
    replies: Sequence[str] | None = None,
    window: int = 2,
    update: Callable[[SessionState, str], SessionState] = update_state,
    use_replies: bool = True,
) -> list[Query]:
    """The query for every turn of one conversation (turn i sees messages[: i + 1] and replies[: i])."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if window < 1:
        raise ValueError(f"window must be >= 1 (got {window})")
    replies = list(replies or [""] * len(messages))
    out: list[Query] = []
    if strategy == "last":
        return [Query(m) for m in messages]
    if strategy == "full":
        for i, msg in enumerate(messages):
            history = [x for pair in zip(messages[:i], replies[:i]) for x in pair if x]
            out.append(Query("\n".join([*history, msg])))
        return out
    seen_replies = list(replies) if use_replies else None
    for i, state in enumerate(run_session(list(messages), update, seen_replies)):
        recent = messages[max(0, i - window + 1): i + 1]
        out.append(Query(session_text(state, recent), tuple(state.excluded()), state))
    return out


class TokenCounter:
    """Counts tokens with SmolLM2's tokenizer (no special tokens), loaded lazily from the committed copy of it
    (`SMOLLM2_TOKENIZER`: SmolLM2's own files, so counting needs no prepared model and works beside random weights)."""

    def __init__(self, tokenizer=None):
        self._tok = tokenizer

    @property
    def tokenizer(self):
        if self._tok is None:
            from lab_utils.models.loader import model_folder
            from lab_utils.models.registry import SMOLLM2_TOKENIZER
            from lab_utils.models.tokenizer import load_tokenizer

            self._tok = load_tokenizer(model_folder(SMOLLM2_TOKENIZER))
        return self._tok

    def __call__(self, texts: Sequence[str]) -> list[int]:
        if not texts:
            return []
        enc = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        return [len(ids) for ids in enc]
