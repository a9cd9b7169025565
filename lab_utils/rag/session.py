"""A small structured session state, updated by rules after every user message.

Why: a follow-up such as "where was she born?" names nothing a retriever can match. Rather than re-sending
the whole history (long, and dominated by old topics), we keep the few facts that make later questions
self-contained -- the entities in focus, the constraints in force (dates, places, "not X") and the user's
goal -- and send those with only the last few raw messages (see `queries.py`).

The rules are deliberately simple and inspectable: capitalised spans are entities, years/centuries and
"in <Place>" are constraints, "not/except/other than X" is a negative constraint, and a message that names an
entity not in focus and has no word pointing back ("he", "it", "what about", ...) starts a new topic. `llm_update` is the
hook for a model-written update (e.g. SmolLM2 through the lab engine) that falls back to these rules.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

MAX_ENTITIES = 3  # more than a few entities in focus turns the state back into a history

# Capitalised words that start questions or commands rather than name things.
NOT_ENTITIES = {
    "what", "who", "whom", "whose", "when", "where", "which", "why", "how", "is", "are", "was", "were", "do",
    "does", "did", "can", "could", "would", "should", "will", "tell", "give", "show", "list", "name", "and",
    "but", "also", "now", "ok", "okay", "i", "i'm", "me", "my", "the", "a", "an", "in", "on", "of", "please",
    "any", "not", "except", "other", "besides", "apart", "only", "its", "his", "her", "their", "it", "he",
    "she", "they", "this", "that", "these", "those", "then", "let's", "let", "what's", "who's", "where's",
    "explain", "describe", "compare", "find", "so", "yes", "no", "thanks",
    "same", "again", "more", "about", "for", "from", "to", "with", "without", "instead", "rather", "excluding",
}
CONNECTORS = {"of", "the", "de", "da", "von", "van", "del", "la", "le", "du", "y", "and", "upon", "al"}
BACK_REFERENCES = {
    "he", "him", "his", "she", "her", "hers", "it", "its", "they", "them", "their", "theirs", "this", "that",
    "these", "those", "there", "then", "same", "else", "instead", "too", "also", "another", "other", "more",
}
CONTINUATIONS = ("what about", "how about", "and what", "and who", "and when", "and where", "and how")
NEGATION = r"(?i:not|except|other than|besides|excluding|apart from|rather than|but not|without)"
_WORD = r"[A-Z][\w'’\-.]*"
_SPAN = rf"{_WORD}(?:\s+(?:(?:{'|'.join(CONNECTORS)})\s+)*(?:{_WORD}|\d+\b))*"
YEAR = re.compile(r"\b(\d{3,4}s?(?:\s?(?:BC|BCE|AD|CE)\b)?|\d{1,2}(?:st|nd|rd|th) century(?:\s?BC)?)(?!\w)")
PLACE = re.compile(rf"\b(?:in|from|near|across|throughout)\s+(?:the\s+)?({_SPAN})")
NEGATED = re.compile(rf"\b{NEGATION}\s+(?:the\s+)?({_SPAN})")
STOPWORDS = NOT_ENTITIES | {
    "me", "about", "you", "your", "is", "be", "been", "some", "many", "much", "most", "first", "did", "has", "have",
    "had", "or", "at", "by", "as", "into", "known", "famous", "really", "there", "here", "out", "up", "one", "than",
} | BACK_REFERENCES


@dataclass(frozen=True)
class SessionState:
    """What the conversation is about right now. Small on purpose: it is re-sent with every query."""

    entities: tuple[str, ...] = ()      # in focus, most recent first, at most MAX_ENTITIES
    constraints: tuple[str, ...] = ()   # "1969", "France", "not Saturn" -- in the order they were given
    goal: str = ""                      # content words of the message that opened the current topic
    turn: int = 0                       # how many user messages have been folded in

    def excluded(self) -> list[str]:
        """Entities the user ruled out ("not X"): a retriever filters these rather than matching them."""
        return [c[4:] for c in self.constraints if c.startswith("not ")]

    def positive_constraints(self) -> list[str]:
        return [c for c in self.constraints if not c.startswith("not ")]

    def render(self) -> str:
        return (f"entities: {', '.join(self.entities) or '-'} | constraints: {', '.join(self.constraints) or '-'}"
                f" | goal: {self.goal or '-'}")


def _clean_span(span: str) -> str:
    span = re.sub(r"['’]s$", "", span.strip().rstrip(".,;:!?'’"))
    words = span.split()
    while words and words[0].lower() in NOT_ENTITIES | CONNECTORS:
        words.pop(0)  # "What Apollo" -> "Apollo"; "The Beatles" keeps "Beatles"
    while words and words[-1].lower() in CONNECTORS:
        words.pop()
    return " ".join(words)


def extract_constraints(message: str) -> list[str]:
    """Dates ("1969", "1960s", "19th century"), places after in/from ("France") and negations ("not Saturn")."""
    out: list[str] = []
    for m in NEGATED.finditer(message):
        span = _clean_span(m.group(1))
        if span:
            out.append(f"not {span}")
    negated = {c[4:] for c in out}
    for m in YEAR.finditer(message):
        out.append(m.group(1))
    for m in PLACE.finditer(message):
        span = _clean_span(m.group(1))
        if span and span not in negated and not YEAR.fullmatch(span):
            out.append(span)
    return list(dict.fromkeys(out))


def extract_entities(message: str) -> list[str]:
    """Capitalised spans ("Marie Curie", "Apollo 11", "Leonardo da Vinci") that are not constraints."""
    constrained = {c.removeprefix("not ") for c in extract_constraints(message)}
    out: list[str] = []
    for m in re.finditer(_SPAN, message):
        span = _clean_span(m.group(0))
        if len(span) > 1 and span not in constrained and span.lower() not in NOT_ENTITIES:  # not "C" of "°C"
            out.append(span)
    return list(dict.fromkeys(out))


def refers_back(message: str) -> bool:
    """Does the message lean on earlier turns (a pronoun, "what about", "else", ...)?"""
    low = message.lower()
    words = set(re.findall(r"[a-z']+", low))
    return bool(words & BACK_REFERENCES) or any(c in low for c in CONTINUATIONS)


def goal_of(message: str, max_words: int = 8) -> str:
    """The message's content words, lower-cased: a compact reminder of what the user set out to learn."""
    message = re.sub(r"['’]s\b", "", NEGATED.sub(" ", message))  # what was ruled out is not the goal
    words = [w for w in re.findall(r"[\w\-]+", message.lower()) if w not in STOPWORDS and not w.isdigit()]
    return " ".join(words[:max_words])


def update_state(state: SessionState, message: str) -> SessionState:
    """Fold one user message into the state (the rule-based reference the lab's exercise is checked against).

    - A new topic when the message names an entity not already in focus and does not refer back: entities,
      constraints and goal start afresh. Naming only entities in focus is a follow-up: after "Tell me about
      Marie Curie.", "What did Marie Curie discover in Paris?" keeps the topic (and adds the place Paris).
    - Otherwise a follow-up: new entities go in front of the old ones (capped at MAX_ENTITIES), new
      constraints are appended to those in force, the goal stays.
    - An entity the user ruled out ("not X") leaves the focus.
    """
    entities = extract_entities(message)
    constraints = extract_constraints(message)
    new_entities = [e for e in entities if e not in state.entities]
    new_topic = state.turn == 0 or (bool(new_entities) and not refers_back(message))
    if new_topic:
        merged_entities, merged_constraints, goal = entities, constraints, goal_of(message)
    else:
        merged_entities = entities + [e for e in state.entities if e not in entities]
        merged_constraints = list(state.constraints) + [c for c in constraints if c not in state.constraints]
        goal = state.goal
    ruled_out = {c[4:] for c in merged_constraints if c.startswith("not ")}
    kept = [e for e in merged_entities if e not in ruled_out][:MAX_ENTITIES]
    return SessionState(tuple(kept), tuple(merged_constraints), goal, state.turn + 1)


def reply_subjects(reply: str) -> list[str]:
    """The subject of each sentence of an assistant reply: the first entity it names ("Caffeine is ...")."""
    out: list[str] = []
    for sentence in re.split(r"(?<=[.!?])\s+", reply):
        ents = extract_entities(sentence)
        if ents:
            out.append(_clean_span(" ".join(ents[0].split()[:4])))  # full legal names can run to 12 words
    return list(dict.fromkeys(out))


def observe_reply(state: SessionState, reply: str) -> SessionState:
    """Fold the assistant's answer in: what it talked about is in focus too ("what other drink contains it?"
    after an answer about caffeine). Only sentence subjects are kept, so the state stays a few words long."""
    subjects = [e for e in reply_subjects(reply) if f"not {e}" not in state.constraints]
    if not subjects:
        return state
    merged = subjects + [e for e in state.entities if e not in subjects]
    return replace(state, entities=tuple(merged[:MAX_ENTITIES]))


def run_session(
    messages: list[str],
    update: Callable[[SessionState, str], SessionState] = update_state,
    replies: list[str] | None = None,
) -> list[SessionState]:
    """The state each message's query is built from (index i: after messages[: i + 1] and replies[: i]).

    With `replies`, the assistant's answer to turn i is observed before message i + 1 arrives.
    """
    states, state = [], SessionState()
    for i, msg in enumerate(messages):
        if i > 0 and replies and replies[i - 1]:
            state = observe_reply(state, replies[i - 1])
        state = update(state, msg)
        states.append(state)
    return states


# ---- optional: a model writes the update ------------------------------------------------------------------
LLM_PROMPT = (
    "You track what a conversation is about. Current state as JSON:\n{state}\n"
    "New user message: {message}\n"
    'Reply with only the updated JSON object with keys "entities" (at most 3 names, most recent first), '
    '"constraints" (dates, places, and "not X" for excluded things) and "goal".'
)


def llm_update(state: SessionState, message: str, generate: Callable[[str], str]) -> SessionState:
    """Ask a model (any `prompt -> text` function, e.g. SmolLM2 via `LLMEngine.generate`) for the new state.

    Small models often return broken JSON or drop facts, so the rule-based update is the fallback and its
    constraints are always kept: a model may add facts, never silently lose one the rules found.
    """
    rules = update_state(state, message)
    current = json.dumps({"entities": list(state.entities), "constraints": list(state.constraints), "goal": state.goal})
    reply = generate(LLM_PROMPT.format(state=current, message=message))
    match = re.search(r"\{.*\}", reply, flags=re.DOTALL)
    try:
        data = json.loads(match.group(0)) if match else None
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        return rules
    ents = [str(e) for e in data.get("entities", []) if isinstance(e, (str, int))][:MAX_ENTITIES] or list(rules.entities)
    cons = [str(c) for c in data.get("constraints", []) if isinstance(c, (str, int))]
    cons = list(rules.constraints) + [c for c in cons if c not in rules.constraints]
    goal = str(data.get("goal") or rules.goal)
    return replace(rules, entities=tuple(ents), constraints=tuple(cons), goal=goal)
