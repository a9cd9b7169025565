"""The dense retriever: all-MiniLM-L6-v2 from the installed package, offline, with an on-disk cache."""
from __future__ import annotations

import numpy as np
import pytest

from lab_utils.rag import retrievers
from lab_utils.rag.corpus import load_corpus

pytestmark = pytest.mark.slow  # loads a 90 MB model (~10 s on 2 cores)


def test_dense_retrieves_by_meaning_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_UTILS_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    small = load_corpus().slice(["Marie Curie", "Moon", "Tea", "Mount Everest"], extra=16, seed=0)
    calls = []
    real_embed = retrievers.embed
    monkeypatch.setattr(retrievers, "embed", lambda texts, **kw: calls.append(len(texts)) or real_embed(texts, **kw))

    dense = retrievers.DenseRetriever(small, progress=False)
    assert calls == [20] and (tmp_path / "rag" / "all-MiniLM-L6-v2.npz").exists()
    norms = np.linalg.norm(dense.matrix, axis=1)
    assert dense.matrix.shape == (20, 384) and np.allclose(norms, 1, atol=1e-4)

    # no shared words with the article, only meaning
    hits = dense.search(["the tallest peak on the planet", "a hot drink made from leaves"], k=3)
    assert hits[0][0] == "Mount Everest" and hits[1][0] == "Tea"
    assert "Tea" not in dense.search(["a hot drink made from leaves"], k=3, exclude=[["Tea"]])[0]

    calls.clear()
    dense.search(["the tallest peak on the planet"], k=1)
    assert calls == []  # queries are cached as well
    again = retrievers.DenseRetriever(small.slice(["Tea"], extra=5, seed=1), progress=False)
    assert calls == []  # a sub-slice reuses the cached vectors
    hybrid = retrievers.HybridRetriever([retrievers.BM25Retriever(small), dense])
    assert hybrid.search(["Marie Curie radioactivity"], k=3)[0][0] == "Marie Curie"
    assert again.matrix.shape[1] == 384
