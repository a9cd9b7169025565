"""The evaluation file: one JSON object per line,
`{"id": str, "turns": [{"user": str, "gold": [titles], "constraints": [str, ...]}, ...]}`.

A malformed line must fail loudly with its line number and field (a silently skipped conversation would
bias every figure), and a gold title missing from the corpus is an error too: it could never be retrieved,
so it would quietly cap recall.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from lab_utils.paths import DATA_DIR
from lab_utils.rag.corpus import Corpus

DEFAULT_PATH = DATA_DIR / "retrieval" / "conversations.jsonl"


class ConversationFormatError(ValueError):
    """A line of a conversation file does not follow the format (message names the line and the field)."""


class UnknownTitlesError(ValueError):
    """Gold titles that the corpus does not contain (listed with where they occur)."""

    def __init__(self, unknown: dict[str, list[str]]):
        self.unknown = unknown
        where = "; ".join(f"{t!r} ({', '.join(places)})" for t, places in sorted(unknown.items()))
        super().__init__(f"{len(unknown)} gold title(s) not in the corpus: {where}")


@dataclass(frozen=True)
class Turn:
    user: str
    gold: tuple[str, ...]
    constraints: tuple[str, ...] = ()


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]
    line: int = 0

    @property
    def messages(self) -> list[str]:
        return [t.user for t in self.turns]


def _str_list(value, where: str, nonempty: bool) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) and x.strip() for x in value):
        raise ConversationFormatError(f"{where} must be a list of non-empty strings (got {value!r})")
    if nonempty and not value:
        raise ConversationFormatError(f"{where} must list at least one title")
    return tuple(value)


def parse_line(text: str, lineno: int, path: str = "<string>") -> Conversation:
    """One line -> Conversation, or ConversationFormatError naming `path:line` and the field at fault."""
    at = f"{path}:{lineno}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConversationFormatError(f"{at}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ConversationFormatError(f"{at}: expected a JSON object, got {type(obj).__name__}")
    extra = set(obj) - {"id", "turns"}
    if extra:
        raise ConversationFormatError(f"{at}: unknown field(s) {sorted(extra)} (allowed: id, turns)")
    cid = obj.get("id")
    if not isinstance(cid, str) or not cid.strip():
        raise ConversationFormatError(f"{at}: field 'id' must be a non-empty string (got {cid!r})")
    turns = obj.get("turns")
    if not isinstance(turns, list) or not turns:
        raise ConversationFormatError(f"{at}: field 'turns' must be a non-empty list (got {turns!r})")
    parsed = []
    for i, turn in enumerate(turns):
        where = f"{at}: turns[{i}]"
        if not isinstance(turn, dict):
            raise ConversationFormatError(f"{where} must be an object with user, gold, constraints")
        extra = set(turn) - {"user", "gold", "constraints"}
        if extra:
            raise ConversationFormatError(f"{where}: unknown field(s) {sorted(extra)} (allowed: user, gold, constraints)")
        user = turn.get("user")
        if not isinstance(user, str) or not user.strip():
            raise ConversationFormatError(f"{where}.user must be a non-empty string (got {user!r})")
        if "gold" not in turn:
            raise ConversationFormatError(f"{where}.gold is missing")
        gold = _str_list(turn["gold"], f"{where}.gold", nonempty=True)
        constraints = _str_list(turn.get("constraints", []), f"{where}.constraints", nonempty=False)
        parsed.append(Turn(user.strip(), gold, constraints))
    return Conversation(cid, tuple(parsed), lineno)


def check_titles(conversations: Iterable[Conversation], corpus: Corpus) -> None:
    """Raise UnknownTitlesError listing every gold title the corpus lacks (and where each is used)."""
    unknown: dict[str, list[str]] = {}
    for conv in conversations:
        for i, turn in enumerate(conv.turns):
            for title in turn.gold:
                if title not in corpus:
                    unknown.setdefault(title, []).append(f"line {conv.line} {conv.id} turn {i}")
    if unknown:
        raise UnknownTitlesError(unknown)


def load_conversations(path: str | Path = DEFAULT_PATH, corpus: Corpus | None = None) -> list[Conversation]:
    """Parse and validate a file; with `corpus`, also check that every gold title exists in it."""
    path = Path(path)
    out: list[Conversation] = []
    seen: dict[str, int] = {}
    for lineno, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        conv = parse_line(text, lineno, str(path))
        if conv.id in seen:
            raise ConversationFormatError(f"{path}:{lineno}: field 'id' {conv.id!r} repeats line {seen[conv.id]}")
        seen[conv.id] = lineno
        out.append(conv)
    if not out:
        raise ConversationFormatError(f"{path}: no conversations")
    if corpus is not None:
        check_titles(out, corpus)
    return out


def gold_titles(conversations: Iterable[Conversation]) -> list[str]:
    """Every gold title, first occurrence order (what a corpus slice must keep)."""
    return list(dict.fromkeys(t for c in conversations for turn in c.turns for t in turn.gold))
