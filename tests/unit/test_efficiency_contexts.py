"""Lab 15's shorter contexts (lab_utils.efficiency.contexts): prompts built piece by piece are the chat template's
own ids, the compressor drops the least surprising history words whole until its budget is met and never a
template token, the system message or the question, the whole-word check refuses a prompt that cuts a word or a
template token, and the teacher-forced answer check agrees with the engine's own greedy answer."""
from __future__ import annotations

import os
import random

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lab_utils.efficiency import contexts  # noqa: E402

SYSTEM = "You are a helpful assistant."


@pytest.fixture(scope="module")
def tok():
    from lab_utils.models.loader import model_folder
    from lab_utils.models.tokenizer import load_tokenizer

    return load_tokenizer(model_folder("smollm2-135m"))


@pytest.fixture(scope="module")
def lab11():
    from lab_utils.rag.conversations import load_conversations
    from lab_utils.rag.corpus import load_corpus

    return load_conversations(), load_corpus()


def template_ids(tok, messages):
    ids = tok.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=True,
                                  add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_words_join_back_to_the_text():
    text = "Tell me  about\nMarie Curie. "
    assert "".join(contexts.words(text)) == text
    assert contexts.words("Who was she?") == ["Who", " was", " she?"]


def test_contexts_are_the_chat_templates_own_ids(tok, lab11):
    convs, corpus = lab11
    for convo in convs[:10]:
        i = len(convo.turns) - 1
        v = contexts.variants(tok, SYSTEM, convo, corpus, i, last_n=1)
        pairs = [(t.user, contexts.reply(t, corpus)) for t in convo.turns[:i]]
        full = [("system", SYSTEM)] + [m for u, a in pairs for m in (("user", u), ("assistant", a))] + \
            [("user", convo.turns[i].user)]
        assert v["full"].ids == template_ids(tok, full)
        assert v["last"].ids == template_ids(tok, full[:1] + full[-3:])  # the last earlier turn, then the question
        assert len(v["session"]) < len(v["last"]) < len(v["full"])


def test_the_session_variant_carries_lab_11s_state(tok, lab11):
    from lab_utils.rag.session import run_session

    convs, corpus = lab11
    convo = next(c for c in convs if c.id == "curie")
    replies = [contexts.reply(t, corpus) for t in convo.turns[:3]]
    state = run_session([t.user for t in convo.turns[:4]], replies=replies)[-1]
    text = tok.decode(contexts.variants(tok, SYSTEM, convo, corpus, 3)["session"].ids)
    assert state.render() in text and "Curie" in state.render()
    assert text.rstrip().endswith("Who was her husband?<|im_end|>\n<|im_start|>assistant")


def full_context(tok, lab11):
    convs, corpus = lab11
    return contexts.variants(tok, SYSTEM, convs[0], corpus, len(convs[0].turns) - 1)["full"]


def test_the_compressor_drops_the_least_surprising_words_to_its_budget(tok, lab11):
    ctx = full_context(tok, lab11)
    rng = random.Random(0)
    surprisal = [rng.uniform(0, 10) for _ in range(len(ctx))]
    budget = len(ctx) // 2
    small = contexts.compress(ctx, surprisal, budget)
    assert len(small) <= budget
    assert contexts.whole_words_only(ctx, small.ids)
    kept = {id(p) for p in small.pieces}
    scores = contexts.word_scores(ctx, surprisal)
    dropped = [s for p, s in zip(ctx.pieces, scores) if id(p) not in kept]
    still = [s for p, s in zip(ctx.pieces, scores) if id(p) in kept and p.kind == "word"]
    assert dropped and max(dropped) <= min(still)  # every dropped word less surprising than every kept one
    assert all(p.kind == "word" for p in ctx.pieces if id(p) not in kept)


def test_a_budget_below_the_protected_pieces_is_not_met_and_nothing_protected_goes(tok, lab11):
    ctx = full_context(tok, lab11)
    small = contexts.compress(ctx, [1.0] * len(ctx), budget=5)
    assert len(small) > 5
    assert all(p.kind != "word" for p in small.pieces)
    assert contexts.whole_words_only(ctx, small.ids)


def test_random_drop_meets_the_same_budget(tok, lab11):
    ctx = full_context(tok, lab11)
    small = contexts.random_drop(ctx, len(ctx) // 2, random.Random(1))
    assert len(small) <= len(ctx) // 2 and contexts.whole_words_only(ctx, small.ids)


def test_whole_words_only_refuses_a_cut_word_a_template_token_and_a_cut_question(tok, lab11):
    ctx = full_context(tok, lab11)
    ids = ctx.ids
    assert contexts.whole_words_only(ctx, ids)
    starts, k = [], 0
    for p in ctx.pieces:
        starts.append(k)
        k += len(p.ids)
    long_word = next(i for i, p in enumerate(ctx.pieces) if p.kind == "word" and len(p.ids) > 1)
    cut = ids[:starts[long_word]] + ids[starts[long_word] + 1:]  # one token of a word
    assert not contexts.whole_words_only(ctx, cut)
    template = next(i for i, p in enumerate(ctx.pieces) if p.kind == "template" and i > 0)
    no_marker = ids[:starts[template]] + ids[starts[template] + len(ctx.pieces[template].ids):]
    assert not contexts.whole_words_only(ctx, no_marker)
    question = max(i for i, p in enumerate(ctx.pieces) if p.kind == "kept")
    no_question_word = ids[:starts[question]] + ids[starts[question] + 1:]
    assert not contexts.whole_words_only(ctx, no_question_word)
    assert not contexts.whole_words_only(ctx, ids + [ids[-1]])


def test_a_single_token_dropper_breaks_words(tok, lab11):
    """The negative control of the compressor: drop the least surprising TOKENS (not words) to the same budget."""
    ctx = full_context(tok, lab11)
    rng = random.Random(2)
    surprisal = [rng.uniform(0, 10) for _ in range(len(ctx))]
    budget = len(ctx) // 2
    order = sorted(range(1, len(ctx)), key=surprisal.__getitem__)
    drop = set(order[:len(ctx) - budget])
    tokens = [t for i, t in enumerate(ctx.ids) if i not in drop]
    assert len(tokens) <= budget and not contexts.whole_words_only(ctx, tokens)


def test_teacher_forced_agreement_matches_the_engines_greedy_answer():
    """On a tiny float64 engine: the reference is the engine's greedy answer, so the full context agrees on all of
    it; a different prompt agrees on fewer leading tokens (or all, never more than k)."""
    from lab_utils.checks import lab15

    engine = lab15._tiny_engine()
    rng = random.Random(0)
    prompt = [rng.randrange(3, 200) for _ in range(40)]
    other = prompt[20:]

    def ctx(ids):
        return contexts.Context((contexts.Piece(tuple(ids), "kept"),))

    scores = contexts.quality(engine, [{"full": ctx(prompt), "other": ctx(other)}], k=6)
    assert scores["full"][0][0] == 6
    assert 0 <= scores["other"][0][0] <= 6 and scores["other"][0][1] <= 0.0


def test_first_token_times_interleave_and_add_the_work_before():
    from lab_utils.checks import lab15

    engine = lab15._tiny_engine()
    prompts = {"a": [[5, 6, 7, 8]], "b": [[9, 10]]}
    times = contexts.first_token_times(engine, prompts, rounds=2, before={"b": lambda j: 100.0})
    assert set(times) == {"a", "b"} and all(len(ts) == 2 for ts in times.values())
    assert all(t >= 100.0 for t in times["b"]) and all(0 < t < 100.0 for t in times["a"])
