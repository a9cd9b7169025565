"""Checks for lab 11's exercise: the rule-based session-state update.

The learner's `update_state(state, message)` is run on fresh random conversations (built from templates with
random entities, dates, places and "not X" constraints) next to the reference in `lab_utils.rag.session`.
On the first turn where the two states differ, the check names the turn, the messages so far, the field, and
expected vs got, plus a diagnosis when the difference matches a known mistake. It never shows the solution.
"""
from __future__ import annotations

import os
import random
from collections.abc import Callable

from lab_utils.checks.claims import Claim
from lab_utils.rag.session import MAX_ENTITIES, SessionState, extract_entities, refers_back, update_state

ENTITIES = ["Marie Curie", "Apollo 11", "Leonardo da Vinci", "Mount Everest", "Nelson Mandela", "Great Wall of China",
            "Isaac Newton", "Frida Kahlo", "Amazon River", "Alan Turing", "Taj Mahal", "Roger Federer", "Nikola Tesla",
            "Pablo Picasso", "Charles Darwin", "Inca Empire", "Hagia Sophia", "Mozart", "Kublai Khan", "Jupiter"]
PLACES = ["France", "Japan", "Peru", "Egypt", "Italy", "Mexico", "India", "Poland"]
OPENERS = ["Tell me about {e}.", "Who was {e}?", "What is {e} known for?", "Why is {e} famous?",
           "Compare {e} with {e2}."]  # a topic opened with two entities: both are in focus, in order
FOLLOW_UPS = [
    "Where was she born?", "When did it happen?", "Why is he remembered?", "How big is it?",
    "What about {e}?", "How about {e} then?", "And what did {e} do there?",
    "What did they do in {y}?", "Did he live in {p}?", "What happened there in the {c}?",
    "Which others are similar, not {f}?", "Any besides {f}?", "What else, other than {f}?",
    "When did the construction end?", "Who built the first one?",
]
SHIFTS = ["Now tell me about {e}.", "Who was {e}?", "What was {e} famous for in {y}?", "Describe {e} in {p}.",
          "How is {e} like {e2}?"]


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
        e2 = rng.choice([x for x in ENTITIES if x != e]) if "{e2}" in template else ""
        msg = template.format(e=e, e2=e2, f=f, p=rng.choice(PLACES), y=rng.randint(1500, 2020), c=c)
        if "{e2}" in template:
            focus.insert(0, e2)
        if "{e}" in template:
            focus.insert(0, e)
        msgs.append(msg)
    return msgs


def _new_topic(prev: SessionState, msg: str) -> bool:
    """Whether `msg` opens a topic (the rule the exercise states)."""
    return prev.turn == 0 or (any(e not in prev.entities for e in extract_entities(msg)) and not refers_back(msg))


def _diagnose(field: str, got, expected, prev: SessionState, new: SessionState, msg: str = "") -> str | None:
    if field == "entities":
        if len(got) > MAX_ENTITIES:
            return f"more than MAX_ENTITIES={MAX_ENTITIES} entities kept: cap the focus, keeping the most recent"
        if list(got) == list(expected)[::-1] or (set(got) == set(expected) and list(got) != list(expected)):
            return "right entities, wrong order: the newest entities go first"
        if any(f"not {e}" in new.constraints for e in got):
            return 'an entity the user ruled out ("not X") is still in focus'
        opens = _new_topic(prev, msg)
        if opens and set(expected) > set(got):
            return (f"this message opens a topic: the focus is every entity it names, in order "
                    f"({', '.join(expected)}); you kept {len(got)} of them")
        if not opens and prev.entities and set(expected) > set(got):
            return "entities in focus were dropped on a follow-up: keep the earlier ones behind the new ones"
        if set(got) > set(expected):
            return ("old entities survived a topic change: a message that names an entity not in focus, with no "
                    "back-reference, starts afresh")
        return ("the focus: on a new topic the entities the message names; on a follow-up those, then the ones "
                f"already in focus; without ruled-out ones (\"not X\"); at most MAX_ENTITIES={MAX_ENTITIES}")
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
                    hint = _diagnose(field, g, e, ref, expected, msg)
                    named = extract_entities(msg)
                    if (i > 0 and named and not refers_back(msg) and all(x in ref.entities for x in named)
                            and field in ("entities", "constraints", "goal")):  # the case "new" is about
                        hint = (f"this message names only entities already in focus ({', '.join(named)}): that is a "
                                f"follow-up, not a new topic (a new topic needs an entity not in focus)")
                    raise AssertionError(
                        f"after message {i} the field `{field}` differs.\nconversation so far:\n{history}\n"
                        f"state before it (reference): {ref.render()}\nexpected {field} = {e!r}\ngot      {field} = {g!r}"
                        + (f"\nLikely cause: {hint}" if hint else "")
                    )
            mine, ref = got, expected
    print(f"check_update_state passed: {conversations} random conversations give the reference state after every message")


# --- the prompt the LLM reads: a layout that keeps the conversation's prefix cacheable -----------------------


def reference_layout(system: str, history: list[str], state: str, passages: list[str], message: str) -> str:
    """Stable first (system, then the history, oldest first: it only grows), volatile after it (the session state
    and the retrieved passages change every turn), the new message last."""
    return "\n\n".join([system, *history, state, *passages, message])


def volatile_first_layout(system: str, history: list[str], state: str, passages: list[str], message: str) -> str:
    """The layout that puts what changes every turn first: nothing after it is ever a cached prefix."""
    return "\n\n".join([system, state, *passages, *history, message])


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(["alpha", "river", "Paris", "1898", "radium", "king", "song", "light", "stone", "sea"])
                    + str(rng.randrange(100)) for _ in range(n))


def layout_conversation(rng: random.Random, turns: int) -> list[dict]:
    """Per turn, the five segments a layout function is given (history grows by the previous user message and
    reply; state and passages change every turn)."""
    system, history, out = "You answer from the passages. " + _words(rng, 6), [], []
    for _ in range(turns):
        message = "Q: " + _words(rng, rng.randint(3, 8)) + "?"
        out.append(dict(system=system, history=list(history), state="state: " + _words(rng, rng.randint(2, 6)),
                        passages=["passage: " + _words(rng, rng.randint(5, 15)) for _ in range(rng.randint(1, 3))],
                        message=message))
        history += [message, "A: " + _words(rng, rng.randint(4, 12))]
    return out


def check_prompt_layout(fn: Callable[..., str], seed: int | None = 0, conversations: int = 30) -> None:
    """`fn(system, history, state, passages, message) -> str` on random conversations: every segment in the
    prompt, the new message last, and from one turn to the next the prompt keeps the system prompt and the whole
    previous history as its common prefix (what a prefix cache can serve). Names the segment that breaks it."""
    rng = random.Random(seed)
    for c in range(conversations):
        convo = layout_conversation(rng, rng.randint(2, 5))
        prev = None
        for t, seg in enumerate(convo):
            got = fn(seg["system"], list(seg["history"]), seg["state"], list(seg["passages"]), seg["message"])
            if not isinstance(got, str):
                raise AssertionError(f"return the prompt as one str, got {type(got).__name__}")
            missing = [name for name in ("system", "state", "message") if seg[name] not in got]
            missing += [f"history[{i}]" for i, h in enumerate(seg["history"]) if h not in got]
            missing += [f"passages[{i}]" for i, x in enumerate(seg["passages"]) if x not in got]
            if missing:
                raise AssertionError(f"conversation {c}, turn {t}: the prompt lacks {missing}: the model reads "
                                     f"only what the prompt holds")
            if not got.rstrip().endswith(seg["message"]):
                raise AssertionError(f"conversation {c}, turn {t}: the prompt ends with {got[-40:]!r}; end with the "
                                     f"new message (the model answers what comes last)")
            if prev is not None:
                stable = prev["system"], *prev["history"]  # what turn t-1 had that turn t keeps, unchanged
                common = len(os.path.commonprefix([prev["prompt"], got]))
                where = [x for x in stable if got.find(x) + len(x) > common or prev["prompt"].find(x) + len(x) > common]
                if where:
                    at = got[common:common + 40]
                    if got.find(seg["state"]) < got.find(seg["history"][0]) or any(
                            got.find(x) < got.find(seg["history"][0]) for x in seg["passages"]):
                        hint = ("the session state and the retrieved passages change every turn; placed before the "
                                "history they end the common prefix there, and the whole history is prefilled "
                                "again: put them after it")
                    elif got.find(seg["history"][-1]) < got.find(seg["history"][0]):
                        hint = ("keep the history oldest first: a new turn is appended at its end, so the older "
                                "turns stay a prefix")
                    else:
                        hint = "the system prompt, then the history, unchanged from turn to turn, must lead"
                    raise AssertionError(
                        f"conversation {c}, turn {t}: this prompt and the previous turn's share only their first "
                        f"{common} characters (they part at {at!r}), so the previous turn's history is not a common "
                        f"prefix\n   hint: {hint}")
            prev = dict(seg, prompt=got)
    print(f"✔ check_prompt_layout: on {conversations} random conversations every prompt holds its segments, ends "
          f"with the message, and keeps the previous turn's system prompt and history as a prefix")


def prefix_hits(layout: Callable[..., str], conversations: list[list[dict]], engine_factory, tokenizer) -> dict:
    """Each conversation's turns, laid out by `layout`, prefilled one after another (max_tokens=1) by a fresh
    engine with prefix caching: the engine's own hit rate and prompt tokens."""
    from lab_utils.engine.sampling_params import SamplingParams

    engine = engine_factory()
    prompt_tokens = 0
    for convo in conversations:
        for seg in convo:
            ids = tokenizer(layout(**seg), add_special_tokens=False).input_ids
            prompt_tokens += len(ids)
            engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
    stats = engine.stats()
    return {"hit_rate": stats["prefix_cache_hit_rate"], "prompt_tokens": prompt_tokens,
            "cached_tokens": round(stats["prefix_cache_hit_rate"] * prompt_tokens)}


def check_layout_in_engine(fn: Callable[..., str], tokenizer, seed: int = 0) -> dict:
    """The real engine (prefix caching on, a tiny random model: hits depend only on the tokens) prefills random
    conversations turn by turn laid out by `fn`, by the reference and by the volatile-first layout: yours must
    hit the cache about as often as the reference, and more than volatile-first."""
    from lab_utils.engine.config import EngineConfig
    from lab_utils.engine.engine import LLMEngine
    from lab_utils.models.loader import build_random
    from lab_utils.models.registry import REGISTRY

    model = build_random(REGISTRY["tiny-random"].config, seed=0).eval()
    rng = random.Random(seed)
    convos = [layout_conversation(rng, 4) for _ in range(3)]

    def factory():
        return LLMEngine((model, None), EngineConfig(block_size=16, num_gpu_blocks=512, max_model_len=1024,
                                                     enable_prefix_caching=True), device="cpu")

    got = {name: prefix_hits(f, convos, factory, tokenizer)
           for name, f in (("yours", fn), ("reference", reference_layout), ("volatile first", volatile_first_layout))}
    yours, ref, bad = got["yours"]["hit_rate"], got["reference"]["hit_rate"], got["volatile first"]["hit_rate"]
    if yours < 0.9 * ref or yours <= bad:
        raise AssertionError(f"in the engine, your layout's prompts hit the prefix cache for {yours:.0%} of their "
                             f"tokens; the reference layout {ref:.0%}, volatile-first {bad:.0%}: put what stays the "
                             f"same from turn to turn first")
    print(f"✔ check_layout_in_engine: the engine served {yours:.0%} of your prompts' tokens from its prefix cache "
          f"(reference layout {ref:.0%}, volatile first {bad:.0%})")
    return got


# --- the lab's closing claims --------------------------------------------------------------------------------


def claims(r: dict) -> list[Claim]:
    """Lab 11's claims from the run's follow-up summaries `r["followup"][retriever][strategy]` (recall@5,
    tokens_per_query, constraint_completeness), for each retriever in `r["retrievers"]`, and the engine's prefix
    cache under the learner's prompt layout and a volatile-first one (`r["layout"]`, from `prefix_hits`)."""
    from lab_utils.checks.claims import need

    need(r, "followup", "retrievers", "layout")
    yours, bad = r["layout"]["yours"], r["layout"]["volatile first"]
    out = [(f"measured: the engine served {yours['hit_rate']:.0%} of your layout's prompt tokens from its prefix "
            f"cache, {bad['hit_rate']:.0%} with the changing parts first ({yours['cached_tokens']} vs "
            f"{bad['cached_tokens']} tokens not prefilled again)", yours["hit_rate"] >= bad["hit_rate"] + 0.1)]
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


# every check_* above also records its result in the learner's own log (lab_utils.workshop.records)
from lab_utils.workshop.records import record_checks  # noqa: E402

record_checks(globals())
