"""Streaming text adds up to the final text and never shows a stop string (random ids, random chunking)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lab_utils.server.stream_text import IncrementalDetokenizer, StopHoldBack, StreamText, longest_partial_stop


@pytest.fixture(scope="module")
def tok():
    from lab_utils.models.loader import model_folder
    from lab_utils.models.tokenizer import load_tokenizer

    return load_tokenizer(model_folder("smollm2-135m"))  # tiny-random's tokenizer too


def _final(tok, ids, stops):
    """The engine's non-streamed text: decode everything, cut before the first stop string."""
    text = tok.decode(ids, skip_special_tokens=True)
    for s in stops:
        if s in text:
            text = text[:text.index(s)]
    return text


# ids from the whole vocabulary (byte pieces split multi-byte characters) and a few special tokens
ids_st = st.lists(st.one_of(st.integers(0, 49151), st.integers(0, 300), st.sampled_from([0, 1, 2])),
                  min_size=0, max_size=40)
chunks_st = st.lists(st.integers(1, 4), min_size=40, max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=ids_st, sizes=chunks_st)
def test_incremental_decode_equals_full_decode(tok, ids, sizes):
    d, pieces, i = IncrementalDetokenizer(tok), [], 0
    for n in sizes:
        if i >= len(ids):
            break
        pieces.append(d.add(ids[i:i + n]))
        i += n
    full = tok.decode(ids, skip_special_tokens=True)
    assert full.startswith("".join(pieces)) and "".join(pieces) == d.text
    # what is held back is at most an incomplete character at the end
    assert len(full) - len(d.text) <= 1 or full[len(d.text):].count("\ufffd") >= 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=ids_st, sizes=chunks_st, data=st.data())
def test_stream_equals_final_text_and_never_shows_a_stop_string(tok, ids, sizes, data):
    full = tok.decode(ids, skip_special_tokens=True)
    # stop strings taken from the text itself (so they do occur), plus one that never does
    stops = []
    for _ in range(data.draw(st.integers(0, 3))):
        if len(full) >= 1:
            a = data.draw(st.integers(0, len(full) - 1))
            stops.append(full[a:a + data.draw(st.integers(1, 6))])
    stops.append("\x00never\x00")
    s, sent, i = StreamText(tok, stops), "", 0
    for n in sizes:
        if i >= len(ids):
            break
        sent += s.delta(ids[i:i + n])
        i += n
        assert not any(stop in sent for stop in stops), f"a stop string was streamed: {sent!r}"
    sent += s.final(_final(tok, ids, stops))
    assert sent == _final(tok, ids, stops)


def test_hold_back_keeps_a_possible_stop_start():
    h = StopHoldBack(["</end>"])
    assert h.release("hello </e") == "hello "  # "</e" may become "</end>": held
    assert h.release("hello </ex") == "</ex"  # ruled out: released
    assert h.release("hello </ex </end> more") == " " and h.stopped
    assert h.release("hello </ex </end> more and more") == ""
    assert longest_partial_stop("abc", ["cde", "bcx"]) == 2


def test_a_complete_stop_waits_for_a_longer_one_that_starts_earlier():
    """'!"' holds '"' complete, but '!"!' starting at 0 may still complete and cut earlier: nothing is sent yet."""
    h = StopHoldBack(['!"!', '"'])
    assert h.release("!") == ""  # '!' may start '!"!'
    assert h.release('!"') == "" and not h.stopped  # '"' is complete at 1, but '!"!' may still start at 0
    assert h.release('!"!') == "" and h.stopped  # the earliest stop wins: the final text is ''
    h = StopHoldBack(['!"!', '"'])
    assert h.release("!") == "" and h.release('!"x') == "!" and h.stopped  # '!"!' ruled out: cut at '"'


def test_final_refuses_a_stream_that_is_not_a_prefix(tok):
    s = StreamText(tok, [])
    s.delta(tok("Hello world", add_special_tokens=False).input_ids)
    with pytest.raises(RuntimeError, match="not a prefix"):
        s.final("Goodbye")


def test_decode_cost_does_not_grow_with_the_output(tok):
    """Each add decodes a window of the last piece + the new tokens, not the whole output."""
    calls = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    d = IncrementalDetokenizer(Counting())
    ids = tok(" the quick brown fox jumps over the lazy dog" * 20, add_special_tokens=False).input_ids
    for t in ids:
        d.add([t])
    assert d.text == tok.decode(ids)
    assert max(calls) <= 4, f"decode windows grew to {max(calls)} tokens for a {len(ids)}-token output"
