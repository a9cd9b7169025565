"""Lab 11's checker: it accepts the reference update and rejects each common mistake with a useful message."""
from __future__ import annotations

from dataclasses import replace

import pytest

from lab_utils.checks import lab11
from lab_utils.rag.session import (
    SessionState,
    extract_constraints,
    extract_entities,
    goal_of,
    refers_back,
    update_state,
)


def test_checker_accepts_reference(capsys):
    lab11.check_update_state(update_state, seed=0)
    lab11.check_update_state(update_state)  # fresh random conversations
    assert "check_update_state passed" in capsys.readouterr().out


def _always_new_topic(state, message):
    """Forgets everything each turn: exactly the `last` strategy's blindness."""
    return SessionState(tuple(extract_entities(message)), tuple(extract_constraints(message)), goal_of(message), state.turn + 1)


def _any_entity_is_new(state, message):
    """Reads "new entities" as "any entities": a message naming only the entity in focus restarts the topic."""
    ents = extract_entities(message)
    if state.turn > 0 and ents and not refers_back(message):
        return SessionState(tuple(ents), tuple(extract_constraints(message)), goal_of(message), state.turn + 1)
    return update_state(state, message)


def test_an_entity_already_in_focus_is_not_new():
    with pytest.raises(AssertionError, match="names only entities already in focus"):
        lab11.check_update_state(_any_entity_is_new, seed=0)


def test_the_labs_solution_follows_the_stated_rule(capsys):
    """The lab's own update_state (its exercise cell) passes the check, which follows the reference."""
    import nbformat

    from lab_utils.paths import REPO_ROOT
    from lab_utils.rag import session

    nb = nbformat.read(next((REPO_ROOT / "labs").glob("11_*.ipynb")), as_version=4)
    cell = next(c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith("def update_state("))
    namespace = dict(vars(session))
    exec(compile(cell, "lab11_update_state", "exec"), namespace)
    lab11.check_update_state(namespace["update_state"], seed=0)
    assert "check_update_state passed" in capsys.readouterr().out


def _no_cap(state, message):
    ents, cons = extract_entities(message), extract_constraints(message)
    if state.turn == 0 or (set(ents) - set(state.entities) and not refers_back(message)):
        return SessionState(tuple(ents), tuple(cons), goal_of(message), state.turn + 1)
    merged = ents + [e for e in state.entities if e not in ents]
    out = list(state.constraints) + [c for c in cons if c not in state.constraints]
    ruled = {c[4:] for c in out if c.startswith("not ")}
    return SessionState(tuple(e for e in merged if e not in ruled), tuple(out), state.goal, state.turn + 1)


def _ignores_negation(state, message):
    """Keeps an entity in focus after the user said "not X"."""
    ents, cons = extract_entities(message), extract_constraints(message)
    if state.turn == 0 or (set(ents) - set(state.entities) and not refers_back(message)):
        return SessionState(tuple(ents[:3]), tuple(cons), goal_of(message), state.turn + 1)
    merged = ents + [e for e in state.entities if e not in ents]
    out = list(state.constraints) + [c for c in cons if c not in state.constraints]
    return SessionState(tuple(merged[:3]), tuple(out), state.goal, state.turn + 1)


def _oldest_first(state, message):
    ref = update_state(state, message)
    return replace(ref, entities=tuple(reversed(ref.entities)))


def _mutates(state, message):
    object.__setattr__(state, "turn", state.turn + 5)
    return update_state(state, message)


def _returns_dict(state, message):
    return update_state(state, message).__dict__


@pytest.mark.parametrize("wrong, expect", [
    (_always_new_topic, "were dropped on a follow-up"),
    (_no_cap, "more than MAX_ENTITIES"),
    (_ignores_negation, "ruled out"),
    (_oldest_first, "wrong order"),
    (_mutates, "changed the state it was given"),
    (_returns_dict, "must return a SessionState"),
])
def test_checker_rejects_mistakes(wrong, expect):
    with pytest.raises(AssertionError) as err:
        lab11.check_update_state(wrong, seed=0)
    msg = str(err.value)
    assert expect in msg, msg
    if "differs" in msg:
        assert "expected" in msg and "got" in msg and "conversation so far" in msg


def test_checker_never_shows_the_solution():
    with pytest.raises(AssertionError) as err:
        lab11.check_update_state(_always_new_topic, seed=1)
    assert "def " not in str(err.value) and "merged" not in str(err.value)


# --- the prompt layout: the conversation's prefix stays cacheable ---------------------------------------------
def _state_first(system, history, state, passages, message):
    return "\n\n".join([system, state, *history, *passages, message])


def _newest_first(system, history, state, passages, message):
    return "\n\n".join([system, *history[::-1], state, *passages, message])


def _message_first(system, history, state, passages, message):
    return "\n\n".join([system, *history, message, state, *passages])


def _no_passages(system, history, state, passages, message):
    return "\n\n".join([system, *history, state, message])


def test_layout_checker_accepts_the_reference(capsys):
    lab11.check_prompt_layout(lab11.reference_layout)
    assert "✔" in capsys.readouterr().out


@pytest.mark.parametrize("bad, msg", [
    (_state_first, "change every turn"),
    (lab11.volatile_first_layout, "change every turn"),
    (_newest_first, "oldest first"),
    (_message_first, "end with the new message"),
    (_no_passages, "lacks"),
])
def test_layout_checker_rejects_mistakes(bad, msg):
    with pytest.raises(AssertionError, match=msg):
        lab11.check_prompt_layout(bad)


@pytest.fixture(scope="module")
def tokenizer():
    from lab_utils.rag.queries import TokenCounter

    return TokenCounter().tokenizer


def test_layout_in_engine(tokenizer, capsys):
    got = lab11.check_layout_in_engine(lab11.reference_layout, tokenizer)
    assert got["yours"]["hit_rate"] > got["volatile first"]["hit_rate"]
    with pytest.raises(AssertionError, match="hit the prefix cache"):
        lab11.check_layout_in_engine(_state_first, tokenizer)


def _first_entity_only(state, message):
    """Keeps only the first entity a message names when it opens a topic."""
    new = update_state(state, message)
    opens = state.turn == 0 or (set(extract_entities(message)) - set(state.entities) and not refers_back(message))
    return replace(new, entities=new.entities[:1]) if opens else new


def _drops_old_on_follow_up(state, message):
    """On a follow-up, keeps only the entities the message names."""
    new = update_state(state, message)
    opens = state.turn == 0 or (set(extract_entities(message)) - set(state.entities) and not refers_back(message))
    return new if opens else replace(new, entities=tuple(e for e in new.entities if e in extract_entities(message)))


def test_entity_causes_name_the_mistake_and_stay_silent_on_the_other():
    with pytest.raises(AssertionError) as err:
        lab11.check_update_state(_first_entity_only, seed=0)
    assert "this message opens a topic: the focus is every entity it names" in str(err.value)
    assert "dropped on a follow-up" not in str(err.value)
    with pytest.raises(AssertionError) as err:
        lab11.check_update_state(_drops_old_on_follow_up, seed=0)
    assert "dropped on a follow-up" in str(err.value) and "opens a topic" not in str(err.value)
