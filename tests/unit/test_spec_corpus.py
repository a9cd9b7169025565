"""The heads' training corpus: shard order, a cache name independent of how many shards are built, and held-out
text (every 10th article, the held-out plays, lab 07's chat questions) never in a training prompt."""
from __future__ import annotations

import pytest
import torch

from lab_utils.speculative.training.corpus import CorpusSpec, _sources, fixed_sequences, gen_prompts


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
    from lab_utils.speculative.training.workloads import QUESTIONS

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


def test_assistant_shards_extend_the_corpus_and_keep_lab07_unseen():
    from lab_utils.speculative.training.assistant_prompts import HELDOUT_WORDS, assistant_requests
    from lab_utils.speculative.training.workloads import QUESTIONS

    s = CorpusSpec(gen_shards=1, fixed_shards=1, asst_shards=2)
    assert s.shard_names() == ["heldout", "heldout_asst", "gen00", "fixed00", "asst00", "asst01"]
    assert s.key() == CorpusSpec().key() and s.shards_tag() == "g1f1a2"
    train = assistant_requests(2000)
    held = assistant_requests(100, heldout=True)
    assert len(set(train)) == 2000 and not set(held) & set(train)
    assert assistant_requests(64, offset=64) == train[64:128]        # shard i = requests 64 i .. 64 i + 63
    text = " ".join(train + held).lower()
    assert not any(q.lower() in text for q in QUESTIONS)
    assert not any(f" {w}" in f" {text}" for w in HELDOUT_WORDS), "a training request names a chat-workload subject"
    with pytest.raises(ValueError, match="distinct requests"):
        assistant_requests(10, offset=10 ** 6)


@pytest.fixture()
def tiny_corpus():
    """A real (tiny-random) corpus with one shard of each kind, removed afterwards."""
    import shutil

    from lab_utils.speculative.training.corpus import build_corpus

    spec = CorpusSpec(model="tiny-random", gen_shards=1, fixed_shards=1, asst_shards=1, shard_prompts=3,
                      max_new_tokens=6, fixed_len=24, heldout_prompts=2, seed=9173)
    shutil.rmtree(spec.folder(), ignore_errors=True)
    build_corpus(spec, log=lambda *_: None)
    yield spec
    shutil.rmtree(spec.folder(), ignore_errors=True)


def test_draft_records_from_the_corpus_label_every_position_with_the_targets_greedy_token(tiny_corpus, tok):
    from lab_utils.distill.corpus_targets import corpus_records
    from lab_utils.distill.train import pad_batch
    from lab_utils.speculative.training.corpus import load_corpus_shards

    recs, meta = corpus_records(tiny_corpus, tok)
    shards = load_corpus_shards(tiny_corpus)
    assert len(recs["heldout"]) == 4 and len(recs["train"]) == len(shards["train"]) == 9   # + heldout_asst
    assert meta["top_k"] == 1 and meta["train_tokens"] == sum(len(r["ids"]) for r in recs["train"])
    for r, s in zip(recs["train"], shards["train"]):
        assert torch.equal(r["topk_idx"][:, 0].long(), s.greedy[:-1])      # row t: the target's token t+1
        if s.source == "fixed":
            assert r["n_prompt"] == 1                                      # fixed text: every position
        else:                                                             # generated: from the answer on
            gen = r["ids"][r["n_prompt"]:].long()
            assert torch.equal(gen, s.greedy[r["n_prompt"] - 1: -1])
    b = pad_batch(recs["train"][:3])
    assert b["gen"].sum() > 0 and b["topk_idx"].shape[-1] == 1


def test_generation_starts_at_the_first_answer_token(tok):
    from lab_utils.speculative.training.data import Sequence, _chat, generation_starts

    prompt = _chat(tok, "Why is it that cats purr?")               # ... <|im_start|> ass istant \n
    answer = tok.encode("Cats purr when content.", add_special_tokens=False)
    seqs = [Sequence(torch.tensor(prompt + answer), torch.zeros(1), torch.zeros(1), "chat"),
            Sequence(torch.arange(80), torch.zeros(1), torch.zeros(1), "play"),
            Sequence(torch.arange(30), torch.zeros(1), torch.zeros(1), "fixed")]
    assert generation_starts(seqs, tok) == [len(prompt), 64, 30]
