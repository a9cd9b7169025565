"""`python -m lab_utils rag-eval`: score one query strategy x retriever on a conversation file."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lab_utils.rag.queries import STRATEGIES
from lab_utils.rag.retrievers import RETRIEVERS


def run(args: argparse.Namespace) -> int:
    from lab_utils.rag.conversations import (
        ConversationFormatError,
        UnknownTitlesError,
        load_conversations,
    )
    from lab_utils.rag.corpus import load_corpus
    from lab_utils.rag.evaluate import evaluate
    from lab_utils.rag.retrievers import build_retriever

    corpus = load_corpus()
    try:
        convs = load_conversations(args.conversations, corpus)
    except (ConversationFormatError, UnknownTitlesError, FileNotFoundError) as exc:
        print(f"rag-eval: {exc}", file=sys.stderr)
        return 2
    if args.corpus_slice:
        from lab_utils.rag.conversations import gold_titles

        corpus = corpus.slice(gold_titles(convs), extra=args.corpus_slice, seed=args.seed)
    retriever = build_retriever(args.retriever, corpus)
    res = evaluate(convs, corpus, retriever, args.strategy, k=args.k, retriever_name=args.retriever, window=args.window)
    summary = res.summary()
    summary["corpus_size"] = len(corpus)
    k = args.k
    print(f"{len(convs)} conversations, {summary['num_turns']} turns, corpus {len(corpus)} docs, "
          f"strategy={args.strategy} retriever={args.retriever}")
    print(f"{'turns':<10}{'recall@' + str(k):>10}{'ndcg@' + str(k):>10}{'constraints':>13}{'tokens/query':>14}")
    for name, part in (("all", summary), ("first", summary["first"]), ("followup", summary["followup"])):
        cc = part["constraint_completeness"]
        print(f"{name:<10}{part[f'recall@{k}']:>10.3f}{part[f'ndcg@{k}']:>10.3f}"
              f"{'-' if cc is None else f'{cc:.3f}':>13}{part['tokens_per_query']:>14.1f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {value})")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rag-eval", help="multi-turn retrieval: score a query strategy x retriever (lab 11)")
    p.add_argument("--conversations", required=True, type=Path, help="JSONL file: {id, turns: [{user, gold, constraints}]}")
    p.add_argument("--strategy", choices=STRATEGIES, default="session")
    p.add_argument("--retriever", choices=RETRIEVERS, default="bm25")
    p.add_argument("--k", type=_positive_int, default=5, help="top-k cut-off for recall and nDCG (default 5)")
    p.add_argument("--json", type=Path, default=None, help="write the metrics here")
    p.add_argument("--window", type=_positive_int, default=2, help="raw user messages the session strategy re-sends (default 2)")
    p.add_argument("--corpus-slice", type=int, default=0, metavar="N",
                   help="use only the gold titles plus N random distractors (fast; 0 = whole corpus)")
    p.add_argument("--seed", type=int, default=0, help="seed of the corpus slice")
    p.set_defaults(func=run)
