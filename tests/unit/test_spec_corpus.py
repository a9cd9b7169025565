"""The heads' training corpus: shard order, a cache name independent of how many shards are built, and held-out
text (every 10th article, the held-out plays, lab 07's chat questions) never in a training prompt."""
from __future__ import annotations

import pytest

from lab_utils.spec.heads_corpus import CorpusSpec, _sources, fixed_sequences, gen_prompts


def test_shards_alternate_and_the_cache_name_ignores_their_count():
    s = CorpusSpec(gen_shards=2, fixed_shards=3)
    assert s.shard_names() == ["heldout", "gen00", "fixed00", "gen01", "fixed01", "fixed02"]
    assert s.key() == CorpusSpec(gen_shards=1, fixed_shards=1).key()     # more shards extend the same corpus
    assert s.key() != CorpusSpec(max_new_tokens=32).key()


@pytest.fixture(scope="module")
def tok():
    from lab_utils import load_model

    return load_model("tiny-random", device="cpu")[1]


def test_training_prompts_never_hold_heldout_text(tok):
    from lab_utils.spec.workloads import QUESTIONS

    held_docs, held_plays = _sources(heldout=True)
    train_docs, train_plays = _sources(heldout=False)
    assert held_docs and train_docs and not {d.title for d in held_docs} & {d.title for d in train_docs}
    assert held_plays and not set(held_plays) & set(train_plays)
    text = "\n".join(tok.decode(p) for p in gen_prompts(tok, 40, seed=3, heldout=False))
    text += "\n".join(tok.decode(s) for s in fixed_sequences(tok, 8, 128, seed=3))
    assert not any(q in text for q in QUESTIONS)
    held_titles = {d.title for d in held_docs if len(d.title) > 12}
    assert not any(f"about {t}." in text or f"is {t}?" in text for t in held_titles)
    assert len(fixed_sequences(tok, 4, 64, seed=1)[0]) == 64
