"""Lab 14's trace and arithmetic (lab_utils.kvstore.returning, costs): each turn's history is a prefix of the
next turn's prompt, every conversation returns only after all the others ran, one-offs are spread between the
turns, and the copy-or-recompute arithmetic is the datasheet's."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lab_utils.kvstore import costs, returning  # noqa: E402


def test_round_robin_returns_after_all_others_and_spreads_one_offs():
    prompts = [[(1,), (1, 2)], [(3,), (3, 4)], [(5,), (5, 6)]]
    trace = returning.round_robin(["a", "b", "c"], prompts, one_offs=[(9,), (8,)])
    order = [(t.conversation, t.turn) for t in trace]
    turns = [o for o in order if not o[0].startswith("one-off")]
    assert turns == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("c", 1)]
    assert [o for o in order if o[0].startswith("one-off")] == [("one-off 0", 0), ("one-off 1", 0)]
    assert order.index(("one-off 0", 0)) < order.index(("a", 1)) < order.index(("one-off 1", 0))
    assert [(t.conversation, t.turn) for t in returning.returning(returning_rows(trace))] == \
        [("a", 1), ("b", 1), ("c", 1)]


def returning_rows(trace):
    return [returning.TurnRow(t.conversation, t.turn, len(t.prompt), 0, 0, len(t.prompt), 0, 0.0) for t in trace]


def test_each_turns_history_is_a_prefix_of_the_next_prompt():
    from lab_utils.models.loader import model_folder
    from lab_utils.models.tokenizer import load_tokenizer
    from lab_utils.rag.conversations import DEFAULT_PATH, load_conversations
    from lab_utils.rag.corpus import load_corpus

    corpus = load_corpus()
    convs = load_conversations(DEFAULT_PATH, corpus)
    tok = load_tokenizer(model_folder("smollm2-135m"))
    prompts = returning.chat_prompts(convs, corpus, tok, 3, 3, passage_chars=300)
    assert len(prompts) == 3 and all(len(p) == 3 for p in prompts)
    system = len(tok.encode(returning.SYSTEM, add_special_tokens=False))
    for turns in prompts:
        for a, b in zip(turns, turns[1:]):
            shared = len(a) - len(tok.encode("\n\nAssistant:", add_special_tokens=False))
            assert b[:shared] == a[:shared] and len(b) > len(a)  # the history up to the user's message
    assert len({p[0][:system] for p in prompts}) == 1  # one system prompt for all


def test_prefill_curve_reading_and_the_datasheet_arithmetic():
    seconds = costs.prefill_seconds([(16, 0.1), (64, 0.2), (128, 0.4)])
    assert seconds(16) == pytest.approx(0.1) and seconds(96) == pytest.approx(0.3)
    assert seconds(256) == pytest.approx(0.8)  # the last slope beyond the curve
    assert costs.per_token_prefill_s([(16, 0.1), (64, 0.2), (128, 0.4)]) == pytest.approx(0.2 / 64)
    # Llama-3.1-8B in bf16 over PCIe 5 (64 GB/s): 128 KiB of KV a token, 2.05 us; recompute 16 GFLOP at half of
    # 989 TFLOP/s: 32.4 us
    g = costs.per_token(8.0e9, 32, 8, 128, 2, **costs.H200_PCIE5)
    assert g["kv_bytes"] == 131072
    assert g["copy_s"] == pytest.approx(2.048e-6) and g["recompute_s"] == pytest.approx(32.35e-6, rel=1e-3)
    assert 15 < g["copy_wins_by"] < 16.5
