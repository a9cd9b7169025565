"""Checks for lab 11's exercise: the rule-based session-state update.

The learner's `update_state(state, message)` is run on fresh random conversations (built from templates with
random entities, dates, places and "not X" constraints) next to the reference in `lab_utils.rag.session`.
On the first turn where the two states differ, the check names the turn, the messages so far, the field, and
expected vs got, plus a diagnosis when the difference matches a known mistake. It never shows the solution.
"""
from __future__ import annotations

import random
from collections.abc import Callable

from lab_utils.rag.session import MAX_ENTITIES, SessionState, update_state

ENTITIES = ["Marie Curie", "Apollo 11", "Leonardo da Vinci", "Mount Everest", "Nelson Mandela", "Great Wall of China",
            "Isaac Newton", "Frida Kahlo", "Amazon River", "Alan Turing", "Taj Mahal", "Roger Federer", "Nikola Tesla",
            "Pablo Picasso", "Charles Darwin", "Inca Empire", "Hagia Sophia", "Mozart", "Kublai Khan", "Jupiter"]
PLACES = ["France", "Japan", "Peru", "Egypt", "Italy", "Mexico", "India", "Poland"]
OPENERS = ["Tell me about {e}.", "Who was {e}?", "What is {e} known for?", "Why is {e} famous?"]
FOLLOW_UPS = [
    "Where was she born?", "When did it happen?", "Why is he remembered?", "How big is it?",
    "What about {e}?", "How about {e} then?", "And what did {e} do there?",
    "What did they do in {y}?", "Did he live in {p}?", "What happened there in the {c}?",
    "Which others are similar, not {f}?", "Any besides {f}?", "What else, other than {f}?",
    "When did the construction end?", "Who built the first one?",
]
SHIFTS = ["Now tell me about {e}.", "Who was {e}?", "What was {e} famous for in {y}?", "Describe {e} in {p}."]


def random_conversation(rng: random.Random, turns: int) -> list[str]:
    """Messages that exercise every rule: topic starts and shifts, pronouns, "what about", dates, places,
    negations of an entity in focus, and enough new entities to overflow the cap."""
    msgs: list[str] = []
    focus: list[str] = []
    for i in range(turns):
        if i == 0:
            kind = OPENERS
        else:
            kind = SHIFTS if rng.random() < 0.2 else FOLLOW_UPS
        template = rng.choice(kind)
        e = rng.choice(ENTITIES)
        f = rng.choice(focus) if focus else rng.choice(ENTITIES)
        c = f"{rng.randint(12, 20)}th century"
        msg = template.format(e=e, f=f, p=rng.choice(PLACES), y=rng.randint(1500, 2020), c=c)
        if "{e}" in template:
            focus.insert(0, e)
        msgs.append(msg)
    return msgs


def _diagnose(field: str, got, expected, prev: SessionState, new: SessionState) -> str | None:
    if field == "entities":
        if len(got) > MAX_ENTITIES:
            return f"more than MAX_ENTITIES={MAX_ENTITIES} entities kept: cap the focus, keeping the most recent"
        if list(got) == list(expected)[::-1] or (set(got) == set(expected) and list(got) != list(expected)):
            return "right entities, wrong order: the newest entities go first"
        if any(f"not {e}" in new.constraints for e in got):
            return 'an entity the user ruled out ("not X") is still in focus'
        if prev.entities and set(expected) > set(got):
            return "entities in focus were dropped on a follow-up: keep the earlier ones behind the new ones"
        if set(got) > set(expected):
            return "old entities survived a topic change: a message with new entities and no back-reference starts afresh"
    if field == "constraints":
        if set(got) < set(expected):
            return "constraints given earlier in the same topic were lost: a follow-up adds to them"
        if set(got) > set(expected):
            return "constraints from the previous topic survived a topic change"
        if list(got) != list(expected):
            return "constraints are in the wrong order or repeated: keep the order they were given, each once"
    if field == "goal":
        if got == "" and expected:
            return "the goal is empty: set it from the message that opens a topic (use goal_of)"
        return "the goal changed on a follow-up, or was not reset on a new topic"
    if field == "turn":
        return "`turn` should count the messages folded in so far (previous turn + 1)"
    return None


def check_update_state(fn: Callable[[SessionState, str], SessionState], seed: int | None = None, conversations: int = 200) -> None:
    """`fn(state: SessionState, message: str) -> SessionState` must match the reference on random conversations."""
    rng = random.Random(seed if seed is not None else random.SystemRandom().randrange(2**31))
    for n in range(conversations):
        msgs = random_conversation(rng, rng.randint(3, 7))
        mine, ref = SessionState(), SessionState()
        for i, msg in enumerate(msgs):
            before = (mine.entities, mine.constraints, mine.goal, mine.turn)
            got = fn(mine, msg)
            if not isinstance(got, SessionState):
                raise AssertionError(f"update_state must return a SessionState, got {type(got).__name__}")
            if before != (mine.entities, mine.constraints, mine.goal, mine.turn):
                raise AssertionError("update_state changed the state it was given; build and return a new one")
            expected = update_state(ref, msg)
            for field in ("entities", "constraints", "goal", "turn"):
                g, e = getattr(got, field), getattr(expected, field)
                if isinstance(g, list):
                    g = tuple(g)
                if g != e:
                    history = "\n".join(f"  {j}: {m!r}" for j, m in enumerate(msgs[: i + 1]))
                    hint = _diagnose(field, g, e, ref, expected)
                    raise AssertionError(
                        f"after message {i} the field `{field}` differs.\nconversation so far:\n{history}\n"
                        f"state before it (reference): {ref.render()}\nexpected {field} = {e!r}\ngot      {field} = {g!r}"
                        + (f"\nLikely cause: {hint}" if hint else "")
                    )
            mine, ref = got, expected
    print(f"check_update_state passed: {conversations} random conversations give the reference state after every message")


# --- the lab's closing claims --------------------------------------------------------------------------------


def claims(r: dict) -> list[tuple[str, bool]]:
    """Lab 11's claims from the run's follow-up summaries `r["followup"][retriever][strategy]` (recall@5,
    tokens_per_query, constraint_completeness), for each retriever in `r["retrievers"]`."""
    from lab_utils.checks.claims import need

    need(r, "followup", "retrievers")
    out = []
    for name in r["retrievers"]:
        fu = r["followup"][name]
        last, full, sess = fu["last"], fu["full"], fu["session"]
        gain = sess["recall@5"] - last["recall@5"]
        share = sess["tokens_per_query"] / full["tokens_per_query"]
        out += [
            (f"{name}: session beats last by >= 0.15 recall@5 on follow-ups (+{gain:.3f}; the simulated replies are "
             "correct, which helps session and full)", gain >= 0.15),
            (f"{name}: session spends <= 50% of full's tokens per query ({share:.0%})", share <= 0.5),
            (f"{name}: session matches or beats full's recall@5 ({sess['recall@5']:.3f} vs {full['recall@5']:.3f})",
             sess["recall@5"] >= full["recall@5"]),
            (f"{name}: check of the state, not of retrieval (the same rules wrote the annotations and fill the state): "
             f"session carries every constraint (completeness {sess['constraint_completeness']:.2f}), last does not "
             f"({last['constraint_completeness']:.2f})",
             sess["constraint_completeness"] == 1.0 > last["constraint_completeness"]),
        ]
    return out


def assert_claims(r: dict, show: bool = True) -> None:
    """Print lab 11's claims; AssertionError naming each one that fails."""
    from lab_utils.checks.claims import report

    report(claims(r), show)
