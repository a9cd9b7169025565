"""Teacher targets for the draft taken from the heads' corpus (`lab_utils.speculative.training.corpus`), at no teacher cost.

Why: the EAGLE and Medusa heads train on a cached corpus in which every position already carries the target's
greedy token. A greedy draft is accepted where its argmax equals that token, so the same labels distil the draft
(sequence-level KD, Kim & Rush 2016: train on the teacher's own outputs), and draft and heads then learn from the
same text, including the everyday assistant requests. A record has the teacher's greedy token as its one "top-k"
entry: `topk_kd_loss` over one entry is the cross-entropy on that token.
"""
from __future__ import annotations

import torch


def corpus_records(spec, tokenizer) -> tuple[dict[str, list[dict]], dict]:
    """({"train": records, "heldout": records}, meta) in `lab_utils.distill.teacher`'s record format.

    Generated sequences are scored from their answer's first token; fixed text at every position (its labels are
    still the target's greedy tokens, not the text's)."""
    from lab_utils.speculative.training.corpus import load_corpus_shards
    from lab_utils.speculative.training.data import generation_starts

    shards = load_corpus_shards(spec)
    out: dict[str, list[dict]] = {}
    for split, seqs in shards.items():
        starts = generation_starts(seqs, tokenizer)
        recs = []
        for s, start in zip(seqs, starts):
            n_prompt = 1 if s.source == "fixed" else max(start, 1)   # an answer cut at once scores nothing
            recs.append({"ids": s.ids.to(torch.int32), "n_prompt": n_prompt,
                         "topk_idx": s.greedy[:-1, None].to(torch.int32),
                         "topk_val": torch.zeros(len(s.ids) - 1, 1, dtype=torch.float16)})
        out[split] = recs
    meta = {"teacher": spec.model, "source": f"heads corpus {spec.folder().name} ({spec.shards_tag()})",
            "train_tokens": sum(len(r["ids"]) for r in out["train"]), "top_k": 1, "seconds": 0.0}
    return out, meta
