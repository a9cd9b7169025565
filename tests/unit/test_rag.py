"""lab_utils.rag: corpus, conversation file validation, session state, query strategies, metrics, BM25, CLI.

Fast: BM25 on a corpus slice and the shipped conversation file; the dense model lives in test_rag_dense.py.
"""
from __future__ import annotations

import json
import math
import re

import pytest

from lab_utils.rag import conversations as cv
from lab_utils.rag.corpus import Corpus, Doc, load_corpus
from lab_utils.rag.evaluate import (
    carries,
    constraint_completeness,
    evaluate,
    ndcg_at_k,
    recall_at_k,
)
from lab_utils.rag.queries import Query, TokenCounter, assistant_reply, build_queries
from lab_utils.rag.retrievers import (
    BM25Retriever,
    HybridRetriever,
    build_retriever,
    light_stem,
)
from lab_utils.rag.session import (
    SessionState,
    llm_update,
    observe_reply,
    reply_subjects,
    run_session,
    update_state,
)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_corpus()


@pytest.fixture(scope="module")
def convs(corpus):
    return cv.load_conversations(cv.DEFAULT_PATH, corpus)


@pytest.fixture(scope="module")
def small(corpus, convs) -> Corpus:
    return corpus.slice(cv.gold_titles(convs), extra=300, seed=0)


@pytest.fixture(scope="module")
def bm25(small):
    return BM25Retriever(small)


# --- corpus ------------------------------------------------------------------------------------------------


def test_corpus_is_the_wikipedia_summaries(corpus):
    assert len(corpus) > 10_000
    doc = corpus["Marie Curie"]
    assert "physicist" in doc.extract and doc.text.startswith("Marie Curie")
    assert doc.lead().endswith(".") and len(doc.lead()) < len(doc.extract)
    assert len(set(corpus.titles)) == len(corpus)


def test_slice_keeps_titles_and_is_reproducible(corpus):
    a = corpus.slice(["Marie Curie", "Moon"], extra=50, seed=3)
    b = corpus.slice(["Moon", "Marie Curie"], extra=50, seed=3)
    assert a.titles == b.titles and len(a) == 52 and "Marie Curie" in a and "Moon" in a
    assert a.fingerprint() == b.fingerprint() != corpus.slice(["Moon"], extra=50, seed=4).fingerprint()
    with pytest.raises(ValueError, match="Not A Title"):
        corpus.slice(["Not A Title"])


def test_duplicate_titles_rejected():
    with pytest.raises(ValueError, match="duplicate title 'X'"):
        Corpus([Doc("X", "a."), Doc("X", "b.")])


# --- the shipped evaluation set ----------------------------------------------------------------------------


def test_shipped_conversations_meet_the_spec(convs, corpus):
    assert len(convs) >= 60
    assert all(len(c.turns) >= 3 for c in convs)
    cv.check_titles(convs, corpus)  # every gold title exists (raises otherwise)
    followups = [t.user for c in convs for t in c.turns[1:]]
    pronoun = re.compile(r"\b(he|she|it|its|they|them|their|his|her|that|there)\b", re.IGNORECASE)
    assert sum(bool(pronoun.search(u)) for u in followups) >= len(followups) // 2
    with_constraints = [c for c in convs if any(t.constraints for t in c.turns)]
    assert len(with_constraints) >= 15
    negations = [x for c in convs for t in c.turns for x in t.constraints if x.startswith("not ")]
    assert negations, "some conversations rule things out"


# --- malformed files: line number and field ----------------------------------------------------------------

GOOD = {"id": "a", "turns": [{"user": "Who was Marie Curie?", "gold": ["Marie Curie"], "constraints": []}]}


def _write(tmp_path, lines):
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


@pytest.mark.parametrize("bad, pattern", [
    ("{not json", r"c\.jsonl:2: not valid JSON"),
    ([1, 2], r":2: expected a JSON object"),
    ({"turns": GOOD["turns"]}, r":2: field 'id' must be a non-empty string"),
    ({"id": "b", "turns": []}, r":2: field 'turns' must be a non-empty list"),
    ({"id": "b", "turns": [{"gold": ["Moon"]}]}, r":2: turns\[0\]\.user must be a non-empty string"),
    ({"id": "b", "turns": [GOOD["turns"][0], {"user": "and?"}]}, r":2: turns\[1\]\.gold is missing"),
    ({"id": "b", "turns": [{"user": "x", "gold": "Moon"}]}, r":2: turns\[0\]\.gold must be a list"),
    ({"id": "b", "turns": [{"user": "x", "gold": []}]}, r":2: turns\[0\]\.gold must list at least one title"),
    ({"id": "b", "turns": [{"user": "x", "gold": ["Moon"], "constraints": [3]}]}, r":2: turns\[0\]\.constraints must be a list"),
    ({"id": "b", "turns": [{"user": "x", "gold": ["Moon"], "answer": "y"}]}, r":2: turns\[0\]: unknown field\(s\) \['answer'\]"),
    ({"id": "a", "turns": GOOD["turns"]}, r":2: field 'id' 'a' repeats line 1"),
])
def test_malformed_line_names_line_and_field(tmp_path, bad, pattern):
    path = _write(tmp_path, [GOOD, bad])
    with pytest.raises(cv.ConversationFormatError, match=pattern):
        cv.load_conversations(path)


def test_unknown_gold_titles_are_listed(tmp_path, corpus):
    conv = {"id": "b", "turns": [{"user": "x", "gold": ["Moon", "Atlantis (real)"]}, {"user": "y", "gold": ["Nowhere Land"]}]}
    path = _write(tmp_path, [GOOD, conv])
    with pytest.raises(cv.UnknownTitlesError) as err:
        cv.load_conversations(path, corpus)
    assert set(err.value.unknown) == {"Atlantis (real)", "Nowhere Land"}
    assert "line 2 b turn 0" in str(err.value) and "2 gold title(s)" in str(err.value)
    assert len(cv.load_conversations(path)) == 2  # without a corpus only the format is checked


# --- session state -----------------------------------------------------------------------------------------


def test_follow_up_keeps_focus_and_collects_constraints():
    s = run_session(["Tell me about Marie Curie.", "Where was she born?", "What did she discover in 1898?",
                     "Did she work in France?"])
    assert [x.entities for x in s] == [("Marie Curie",)] * 4
    assert s[2].constraints == ("1898",) and s[3].constraints == ("1898", "France")
    assert s[3].goal == "marie curie" and s[3].turn == 4


def test_new_topic_resets_and_what_about_continues():
    s = run_session(["Who was Isaac Newton in 1687?", "Tell me about the Amazon River.", "What about the Nile?"])
    assert s[1].entities == ("Amazon River",) and s[1].constraints == ()  # no back-reference: fresh topic
    assert s[2].entities == ("Nile", "Amazon River")  # "what about" continues it


def test_naming_only_entities_in_focus_is_a_follow_up():
    s = run_session(["Tell me about Marie Curie in 1898.", "What did Marie Curie discover in Paris?",
                     "Tell me about Albert Einstein."])
    assert s[1].entities == ("Marie Curie",) and s[1].goal == s[0].goal  # no entity new to the focus: same topic
    assert s[1].constraints == (*s[0].constraints, "Paris")
    assert s[2].entities == ("Albert Einstein",) and s[2].constraints == ()  # an entity not in focus: new topic


def test_negation_rules_out_an_entity_and_caps_focus():
    s = run_session(["Which planets have rings, like Saturn?", "Which is the largest, not Saturn?"])
    assert "not Saturn" in s[1].constraints and "Saturn" not in s[1].entities and s[1].excluded() == ["Saturn"]
    many = run_session(["Tell me about Mars.", "What about Venus?", "What about Jupiter?", "What about Mercury?"])
    assert many[-1].entities == ("Mercury", "Jupiter", "Venus")


def test_llm_update_hook_merges_and_falls_back():
    state = update_state(SessionState(), "Tell me about Marie Curie.")
    good = llm_update(state, "Where was she born in 1867?",
                      lambda prompt: '{"entities": ["Marie Curie"], "constraints": ["Warsaw"], "goal": "her birthplace"}')
    assert good.entities == ("Marie Curie",) and good.constraints == ("1867", "Warsaw") and good.goal == "her birthplace"
    prompts = []
    broken = llm_update(state, "Where was she born in 1867?", lambda p: prompts.append(p) or "I think {Marie")
    assert broken == update_state(state, "Where was she born in 1867?") and "Marie Curie" in prompts[0]


# --- query strategies --------------------------------------------------------------------------------------


def test_strategies_build_what_they_promise(corpus):
    msgs = ["Tell me about Marie Curie.", "Where was she born?", "What did she discover in 1898?"]
    replies = [assistant_reply(["Marie Curie"], corpus), "", ""]
    last = build_queries(msgs, "last", replies)
    full = build_queries(msgs, "full", replies)
    sess = build_queries(msgs, "session", replies, window=2)
    assert [q.text for q in last] == msgs
    assert full[2].text.startswith(msgs[0]) and corpus["Marie Curie"].lead() in full[2].text and full[2].text.endswith(msgs[2])
    assert sess[2].text.startswith("Maria Salomea Skłodowska Curie Marie Curie 1898") and msgs[1] in sess[2].text and msgs[0] not in sess[2].text
    assert sess[2].text.lower().count("marie") == 1  # the goal does not repeat the entity
    with pytest.raises(ValueError, match="strategy 'all' is not one of last, full, session"):
        build_queries(msgs, "all")
    with pytest.raises(ValueError, match="window must be >= 1"):
        build_queries(msgs, "session", window=0)


def test_token_counter_uses_smollm2():
    count = TokenCounter()
    a, b = count(["Marie Curie", "Marie Curie was a Polish and naturalised-French physicist and chemist."])
    assert 2 <= a < b and count.tokenizer.vocab_size == 49152


# --- metrics -----------------------------------------------------------------------------------------------


def test_recall_and_ndcg():
    assert recall_at_k(["a", "x", "b"], ["a", "b"], k=5) == 1.0
    assert recall_at_k(["x", "a", "b"], ["a", "b"], k=2) == 0.5
    assert ndcg_at_k(["a", "b"], ["a", "b"]) == pytest.approx(1.0)
    assert ndcg_at_k(["x", "a"], ["a"]) == pytest.approx(1 / math.log2(3))
    assert ndcg_at_k(["x", "y"], ["a"]) == 0.0


def test_constraint_carrying():
    assert carries("planets with rings except Saturn", "not Saturn")
    assert not carries("Saturn rings", "not Saturn")
    assert carries("what happened in 1969?", "1969") and not carries("in 19690", "1969")
    state = SessionState(("Moon",), ("1969", "not Mars"), "moon")
    assert constraint_completeness(Query("Moon landing", state=state), ["1969", "not Mars"]) == 1.0
    assert constraint_completeness(Query("Moon landing"), ["1969", "not Mars"]) == 0.0
    assert constraint_completeness(Query("anything"), []) is None


# --- retrievers and evaluation -----------------------------------------------------------------------------


def test_bm25_finds_and_excludes(bm25):
    assert light_stem("rings") == "ring" and light_stem("countries") == "country" and light_stem("glass") == "glass"
    hits = bm25.search(["Marie Curie radioactivity Polish physicist", "zzzz qqqq"], k=5)
    assert hits[0][0] == "Marie Curie" and hits[1] == []  # no shared word: no hit, not random documents
    ex = bm25.search(["Marie Curie radioactivity"], k=5, exclude=[["Marie Curie"]])[0]
    assert "Marie Curie" not in ex and len(ex) == 5


class _Fixed:
    """A retriever with a fixed ranking, to test rank fusion in isolation."""

    def __init__(self, corpus, order):
        self.corpus, self.order = corpus, order

    def scores(self, queries, pool):
        import numpy as np

        idx = [self.corpus.index[t] for t in self.order][:pool]
        return np.array([idx] * len(queries)), np.ones((len(queries), len(idx)))


def test_hybrid_is_reciprocal_rank_fusion(small):
    a = _Fixed(small, ["Moon", "Mars", "Marie Curie"])
    b = _Fixed(small, ["Marie Curie", "Mars", "Moon"])
    c = _Fixed(small, ["Mars", "Jupiter"])
    assert HybridRetriever([a, b, c]).search(["q"], k=3)[0] == ["Mars", "Marie Curie", "Moon"]
    assert HybridRetriever([a, b]).search(["q"], k=2, exclude=[["Mars"]])[0] == ["Marie Curie", "Moon"]
    with pytest.raises(ValueError, match="retriever 'tfidf' is not one of bm25, dense, hybrid"):
        build_retriever("tfidf", small)


def test_session_beats_last_on_follow_ups(convs, small, bm25):
    count = TokenCounter()
    res = {s: evaluate(convs, small, bm25, s, count_tokens=count).summary() for s in ("last", "full", "session")}
    fu = {s: r["followup"] for s, r in res.items()}
    assert fu["session"]["recall@5"] > fu["last"]["recall@5"]
    assert fu["session"]["tokens_per_query"] < fu["full"]["tokens_per_query"]
    assert fu["session"]["constraint_completeness"] == 1.0 > fu["last"]["constraint_completeness"]
    # on a first turn every strategy sends the user's words, so they retrieve alike
    assert res["last"]["first"]["recall@5"] == pytest.approx(res["full"]["first"]["recall@5"])
    assert res["session"]["num_turns"] == sum(len(c.turns) for c in convs)


# --- CLI ---------------------------------------------------------------------------------------------------


def test_cli_writes_the_documented_json(tmp_path, capsys):
    from lab_utils.__main__ import main

    src = tmp_path / "c.jsonl"
    lines = cv.DEFAULT_PATH.read_text().splitlines()[:4]
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "r.json"
    rc = main(["rag-eval", "--conversations", str(src), "--strategy", "session", "--retriever", "bm25",
               "--k", "5", "--json", str(out), "--corpus-slice", "200"])
    assert rc == 0
    data = json.loads(out.read_text())
    for part in (data, data["followup"]):
        assert {"recall@5", "ndcg@5", "constraint_completeness", "tokens_per_query"} <= set(part)
    assert 0 <= data["followup"]["recall@5"] <= 1 and data["num_conversations"] == 4
    assert "followup" in capsys.readouterr().out


def test_cli_reports_bad_files(tmp_path, capsys):
    from lab_utils.__main__ import main

    src = _write(tmp_path, [GOOD, {"id": "b", "turns": [{"user": "x", "gold": ["No Such Article"]}]}])
    assert main(["rag-eval", "--conversations", str(src), "--strategy", "last", "--retriever", "bm25"]) == 2
    assert "No Such Article" in capsys.readouterr().err
    src.write_text(json.dumps(GOOD) + "\n" + '{"id": "c", "turns": [{"user": ""}]}\n')
    assert main(["rag-eval", "--conversations", str(src)]) == 2
    assert "c.jsonl:2: turns[0].user" in capsys.readouterr().err


def test_assistant_replies_put_their_subject_in_focus(corpus):
    reply = assistant_reply(["Caffeine"], corpus)
    assert reply.startswith("Caffeine") and reply_subjects(reply) == ["Caffeine"]
    assert reply_subjects("Diego María de la Concepción Juan Rivera was a painter. He married Frida Kahlo.") == ["Diego María", "Frida Kahlo"]
    msgs = ["Where does coffee come from?", "Which chemical in it keeps people awake?", "What other drink also contains it?"]
    replies = [assistant_reply(["Coffee"], corpus), reply, ""]
    with_replies = run_session(msgs, replies=replies)
    assert with_replies[2].entities[0] == "Caffeine" and "Caffeine" not in run_session(msgs)[2].entities
    ruled = observe_reply(SessionState(("Moon",), ("not Caffeine",), "moon", 1), reply)
    assert ruled.entities == ("Moon",)  # a reply cannot bring back what the user ruled out
    q_user_only = build_queries(msgs, "session", replies, use_replies=False)[2].text
    assert "Caffeine" in build_queries(msgs, "session", replies)[2].text and "Caffeine" not in q_user_only
