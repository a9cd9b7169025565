"""Retrieval for multi-turn conversations (lab 11): a Wikipedia corpus, BM25 / dense / hybrid retrievers,
a small session state that turns follow-ups into self-contained queries, and the evaluation that shows it."""
