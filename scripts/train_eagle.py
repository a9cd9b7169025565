"""Train an EAGLE-style feature-level draft head for SmolLM2-135M-Instruct, evaluate it held out, ship it.

    OMP_NUM_THREADS=1 python scripts/train_eagle.py                       # full run (<= ~20 min on a CPU core)
    OMP_NUM_THREADS=1 python scripts/train_eagle.py --smoke               # ~1 min, a few SmolLM2 sequences

Writes fp16 safetensors + eagle_config.json + README.md (the model card, every figure measured by this run)
to `--out` (default data/models/smollm2-eagle; --smoke writes to a temporary folder).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from lab_utils.paths import DATA_DIR, cache_dir
from lab_utils.speculative.eagle import CONFIG_NAME, EagleHead, eagle_config_for, load_eagle
from lab_utils.speculative.training.corpus import CorpusSpec, add_data_args, describe, load_training_data
from lab_utils.speculative.training.warm_start import chain, load_into, prior_run, runs_line, start_label
from lab_utils.speculative.training.train import eval_eagle, init_eagle, train_eagle
from lab_utils.speculative.medusa import save_heads, top_tokens

SMOKE_DATA = CorpusSpec(gen_shards=1, fixed_shards=1, shard_prompts=6, max_new_tokens=24, fixed_len=96,
                        heldout_prompts=4)
K = 4   # draft steps evaluated


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000, help="AdamW steps (the cosine schedule's length)")
    ap.add_argument("--batch", type=int, default=8, help="crops per step")
    ap.add_argument("--length", type=int, default=32, help="positions per crop")
    ap.add_argument("--window", type=int, default=8, help="rows the head attends over (trained with 1..window)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ce-weight", type=float, default=0.5)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--max-minutes", type=float, default=60.0, help="wall budget of the training loop (a safety stop)")
    ap.add_argument("--out", default=str(DATA_DIR / "models" / "smollm2-eagle"))
    add_data_args(ap)
    ap.add_argument("--val-every", type=float, default=3.0,
                    help="minutes between validation checks (early stopping) and learning-curve points")
    ap.add_argument("--ckpt", default=None, help="resumable checkpoint file (default: in the cache, named by the run)")
    ap.add_argument("--card-only", action="store_true", help="rewrite README.md from --out's train_result.json")
    ap.add_argument("--machine", default="one core of a 2-core x86_64 CPU VM",
                    help="where it trains, for the model card (e.g. how busy the other core was)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def heldout_point(head, target, heldout, starts, window: int) -> dict:
    """One learning-curve point: held-out chain acceptance from 1 true row (after a prefill) and from `window`."""
    a1 = eval_eagle(head, target, heldout, K, n_rows=1, starts=starts, limit=200)
    aw = eval_eagle(head, target, heldout, K, n_rows=window, starts=starts, limit=200)
    return {"first_n1": a1["top1"][0], "first": aw["top1"][0], "conditional": aw["conditional"],
            "mean_accepted": aw["mean_accepted"]}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.card_only:
        r = json.loads((Path(args.out) / "train_result.json").read_text())
        write_card(Path(args.out), r, r["config"], argparse.Namespace(**r["args"]))
        return r
    torch.manual_seed(args.seed)
    spec = SMOKE_DATA if args.smoke else CorpusSpec(gen_shards=args.gen_shards, fixed_shards=args.fixed_shards,
                                                    asst_shards=args.asst_shards)
    if args.smoke:
        args.steps, args.batch, args.length, args.out = 30, 4, 16, tempfile.mkdtemp(prefix="eagle-smoke-")
        args.val_every, args.draft_vocab = 0.05, min(args.draft_vocab, 2048)
    run_name = f"ckpt-eagle-{spec.key()}-{spec.shards_tag()}.pt"   # the corpus it trains on
    ckpt = None if args.smoke else (args.ckpt or cache_dir() / "spec_heads" / run_name)
    t0 = time.time()
    if args.corpus_only:
        from lab_utils.speculative.training.corpus import build_corpus

        build_corpus(spec)
        return {}
    hd = load_training_data(spec)
    target, data, train, val, starts = hd.target, hd.data, hd.train, hd.val, hd.heldout_starts
    head = init_eagle(EagleHead(eagle_config_for(target.config), args.window))
    prior = None
    if args.init_from:  # a second run on a larger corpus, from the first run's weights
        prior = prior_run(args.init_from)
        load_into(head, load_eagle(args.init_from))
    elif args.draft_vocab:
        head.vocab = top_tokens(torch.cat([s.greedy for s in train]), args.draft_vocab)
    before = eval_eagle(head, target, data["heldout"], K, n_rows=1, starts=starts)
    print("held-out before training (n_rows=1):", before)
    log = train_eagle(head, target, train, args.steps, args.batch, args.length, args.lr, args.ce_weight,
                      max_seconds=args.max_minutes * 60, seed=args.seed, log_every=5 if args.smoke else 10,
                      val=val, val_every_s=args.val_every * 60, weight_decay=args.weight_decay,
                      curve=lambda: heldout_point(head, target, data["heldout"], starts, args.window),
                      ckpt=ckpt, log=lambda m: print(m, flush=True))
    after = {n: eval_eagle(head, target, data["heldout"], K, n_rows=n, starts=starts) for n in (1, args.window)}
    for n, r in after.items():
        print(f"held-out after training (n_rows={n}):", r)
    print(f"loss: first {log.mean(True, 5):.3f} -> last {log.mean(False, 5):.3f}")
    cfg = {**head.config(), "target": spec.model, "vocab_size": target.config.vocab_size}
    save_heads(head, cfg, args.out, CONFIG_NAME, head.vocab)
    reloaded = load_eagle(args.out)
    assert torch.allclose(reloaded.fc.weight, head.fc.weight.half().float())
    coverage = None
    if head.vocab is not None:  # share of held-out target tokens the draft vocabulary contains
        g = torch.cat([s.greedy for s in data["heldout"]])
        coverage = round(float(torch.isin(g, head.vocab).float().mean()), 4)
    result = {"data": {"spec": spec.__dict__, **hd.summary()},
              "parameters": sum(p.numel() for p in head.parameters()), "steps": log.steps, "batch": args.batch,
              "length": args.length, "positions_seen": log.positions, "draft_vocab": args.draft_vocab or None,
              "draft_vocab_heldout_coverage": coverage, "seconds": round(log.seconds),
              "validation": {"sequences": len(val), "history": log.val, "best_step": log.best_step},
              "learning_curve": log.curve,
              "loss_first": round(log.mean(True), 4), "loss_last": round(log.mean(False), 4),
              "heldout_untrained": before, "heldout_trained": {str(n): r for n, r in after.items()},
              "config": cfg, "args": {k: v for k, v in vars(args).items() if k != "ckpt"},
              "command": "OMP_NUM_THREADS=1 python scripts/train_eagle.py " + shlex.join(argv)}
    if prior is not None:
        result = chain(result, prior, os.path.relpath(args.out), args.init_from)
    (Path(args.out) / "train_result.json").write_text(json.dumps(result, indent=2) + "\n")
    if not args.smoke:
        write_card(Path(args.out), result, cfg, args)
    print(f"wrote {args.out} [{time.time() - t0:.0f} s]")
    return result


def write_card(folder: Path, r: dict, cfg: dict, args) -> None:
    b, a1, a3 = r["heldout_untrained"], r["heldout_trained"]["1"], r["heldout_trained"][str(cfg["window"])]
    rows = "\n".join(f"| {s} | token t+{s + 2} | {b['top1'][s]:.3f} | {a1['top1'][s]:.3f} | {a1['conditional'][s]:.3f} "
                     f"| {a3['conditional'][s]:.3f} |" for s in range(K))
    d, v = r["data"], r["validation"]
    vocab = (f"a draft vocabulary of the {r['draft_vocab']} most frequent target tokens of the corpus (stored as "
             f"`draft_vocab`, int64; it holds {r['draft_vocab_heldout_coverage']:.1%} of the held-out target tokens), "
             f"so a head step multiplies by {r['draft_vocab']} rows of the lm_head instead of {cfg['vocab_size']}"
             if r.get("draft_vocab") else "the full vocabulary")
    curve = ", ".join(f"{p['positions']:,}: {p['first']:.2f}" for p in r["learning_curve"])
    text = f"""# smollm2-eagle: an EAGLE-style draft head for SmolLM2-135M-Instruct

A feature-level draft head (Li et al. 2024, EAGLE-1 style) for `smollm2-135m`, used by
`SpecConfig(method="eagle")` (`lab_utils/speculative/eagle.py`). It maps (target feature f_t, embedding of x_t+1) through
`fc` (concat 2x{cfg['hidden_size']} -> {cfg['hidden_size']}) and one Llama decoder layer shaped like the target's to the
predicted feature f_t+1; the target's own tied embedding / lm_head (not stored here) turns that into x_t+2, scored over
{vocab}. It drafts k tokens by feeding its predicted feature and chosen token back in, attending over at most
{cfg['window']} rows: the last true hidden rows of the request (kept across calls) plus its own draft steps.
Weights: `model.safetensors` (fp16, {r['parameters']:,} parameters), config: `{CONFIG_NAME}` (named so the model
registry does not mistake this folder for a full model).

## Training
- Target frozen; features are the target's final-norm hidden states, labels its own greedy tokens.
- Corpus: {describe(d)}
- Init: fc = [I, 0] and zero output projections (starts as "next feature = current feature").
{runs_line(r)}- {r['steps']} AdamW steps of {r['batch']} crops x {r['length']} positions ({r['positions_seen']:,} positions seen), lr cosine
  from {args.lr:g} (over {args.steps} steps or {args.max_minutes:g} min, whichever ends first); attention width drawn from
  1..{cfg['window']} per step; loss = smooth-L1(feature) + {args.ce_weight:g} x CE(lm_head(feature), target's token), plus the
  same on a second pass in which half the rows get the head's own previous prediction (and uniform feature noise), so
  it keeps going on its own drafts. The CE runs over the draft vocabulary (what the head scores when serving).
  {r['seconds']} s on {r['args'].get('machine', 'one core of a 2-core x86_64 CPU VM')} (resumable checkpoints).
- Early stopping: {v['sequences']} of the generated training sequences are kept out for validation (mean accepted
  chain length, checked every {args.val_every:g} min); the weights of step {v['best_step']} are shipped.
- Learning curve (`learning_curve` in `train_result.json`; held-out first-guess acceptance by positions seen):
  {curve}.
- Loss (mean of first / last 20 steps): {r['loss_first']:.3f} -> {r['loss_last']:.3f}.

## Held-out agreement with the target's greedy continuation
{a1['positions']} positions in the target's held-out generated answers (not the prompts) where its greedy continuation is known. Draft step s is correct when it equals the target's greedy token;
conditional = the same among positions where steps 0..s-1 were all right (what chain verification accepts);
n = true feature rows the head sees (1: right after a prefill; {cfg['window']}: a running request, whose recent rows the
proposer keeps).

| step | predicts | top-1 {start_label(r)} (n=1) | top-1 trained (n=1) | conditional (n=1) | conditional (n={cfg['window']}) |
|---|---|---|---|---|---|
{rows}

Mean accepted draft tokens per step (chain of {K}): {b['mean_accepted']:.2f} {start_label(r)} -> **{a1['mean_accepted']:.2f}** (n=1),
**{a3['mean_accepted']:.2f}** (n={cfg['window']}) trained.

{engine_section(r)}## Reproduce
```bash
{r['command']}
```
"""
    (folder / "README.md").write_text(text)


def engine_section(r: dict) -> str:
    """Acceptance measured in the engine (added to train_result.json by a separate run, if any)."""
    e = r.get("engine")
    if not e:
        return ""
    rows = "\n".join(f"| {w} | {v['acc']:.3f} | {', '.join(f'{x:.2f}' for x in v['per_pos'])} | {v['tokens_per_step']:.2f} "
                     f"| {v['identical']} |" for w, v in e["workloads"].items())
    return f"""## In the engine
{e['note']}

| workload | acceptance | per position | tokens per verify step | greedy output identical |
|---|---|---|---|---|
{rows}

"""


if __name__ == "__main__":
    main()
