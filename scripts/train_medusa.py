"""Train Medusa heads for SmolLM2-135M-Instruct on its own features, evaluate them held out, ship them.

    OMP_NUM_THREADS=1 python scripts/train_medusa.py                      # full run (<= ~20 min on a CPU core)
    OMP_NUM_THREADS=1 python scripts/train_medusa.py --smoke              # ~1 min, a few SmolLM2 sequences: the loss falls

Writes fp16 safetensors + medusa_config.json + README.md (the model card, every figure measured by this run)
to `--out` (default data/models/smollm2-medusa; --smoke writes to a temporary folder).
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
from lab_utils.speculative.training.corpus import CorpusSpec, add_data_args, describe, load_training_data
from lab_utils.speculative.training.warm_start import chain, load_into, prior_run, runs_line, start_label
from lab_utils.speculative.training.train import eval_medusa, train_medusa
from lab_utils.speculative.medusa import CONFIG_NAME, MedusaHeads, load_medusa, save_heads, top_tokens

SMOKE_DATA = CorpusSpec(gen_shards=1, fixed_shards=1, shard_prompts=6, max_new_tokens=24, fixed_len=96,
                        heldout_prompts=4)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1500, help="AdamW steps (the cosine schedule's length)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-minutes", type=float, default=30.0, help="wall budget of the training loop (a safety stop)")
    ap.add_argument("--out", default=str(DATA_DIR / "models" / "smollm2-medusa"))
    add_data_args(ap)
    ap.add_argument("--val-every", type=float, default=2.0,
                    help="minutes between validation checks (early stopping) and learning-curve points")
    ap.add_argument("--ckpt", default=None, help="resumable checkpoint file (default: in the cache, named by the run)")
    ap.add_argument("--card-only", action="store_true", help="rewrite README.md from --out's train_result.json")
    ap.add_argument("--machine", default="one core of a 2-core x86_64 CPU VM",
                    help="where it trains, for the model card (e.g. how busy the other core was)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    return ap


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
        args.steps, args.batch, args.lr, args.out = 30, 64, 3e-3, tempfile.mkdtemp(prefix="medusa-smoke-")
        args.val_every, args.draft_vocab = 0.05, min(args.draft_vocab, 2048)
    run_name = f"ckpt-medusa-{spec.key()}-{spec.shards_tag()}.pt"   # the corpus it trains on
    ckpt = None if args.smoke else (args.ckpt or cache_dir() / "spec_heads" / run_name)
    t0 = time.time()
    if args.corpus_only:
        from lab_utils.speculative.training.corpus import build_corpus

        build_corpus(spec)
        return {}
    hd = load_training_data(spec)
    target, data, train, val, starts = hd.target, hd.data, hd.train, hd.val, hd.heldout_starts
    heads = MedusaHeads(target.config.hidden_size, args.heads)
    prior = None
    if args.init_from:  # a second run on a larger corpus, from the first run's weights
        prior = prior_run(args.init_from)
        load_into(heads, load_medusa(args.init_from))
    elif args.draft_vocab:
        heads.vocab = top_tokens(torch.cat([s.greedy for s in train]), args.draft_vocab)
    before = eval_medusa(heads, target, data["heldout"], starts=starts)  # untrained = the target's own next-token guess
    print("held-out before training:", before)

    def point() -> dict:
        r = eval_medusa(heads, target, data["heldout"], starts=starts, limit=200)
        return {"first": r["top1"][0], "top1": r["top1"], "mean_accepted": r["mean_accepted"]}

    log = train_medusa(heads, target, train, args.steps, args.batch, args.lr, args.max_minutes * 60,
                       args.seed, log_every=5 if args.smoke else 10, val=val, val_every_s=args.val_every * 60,
                       curve=point, ckpt=ckpt, log=lambda m: print(m, flush=True))
    after = eval_medusa(heads, target, data["heldout"], starts=starts)
    print("held-out after training:", after)
    print(f"loss: first {log.mean(True, 5):.3f} -> last {log.mean(False, 5):.3f}")
    cfg = {**heads.config(), "target": spec.model, "vocab_size": target.config.vocab_size}
    save_heads(heads, cfg, args.out, CONFIG_NAME, heads.vocab)
    reloaded = load_medusa(args.out)
    assert torch.allclose(reloaded.heads[0].linear.weight, heads.heads[0].linear.weight.half().float())
    coverage = None
    if heads.vocab is not None:  # share of held-out target tokens the draft vocabulary contains
        g = torch.cat([s.greedy for s in data["heldout"]])
        coverage = round(float(torch.isin(g, heads.vocab).float().mean()), 4)
    result = {"data": {"spec": spec.__dict__, **hd.summary()},
              "parameters": sum(p.numel() for p in heads.parameters()), "steps": log.steps, "batch": args.batch,
              "positions_seen": log.positions, "draft_vocab": args.draft_vocab or None,
              "draft_vocab_heldout_coverage": coverage, "seconds": round(log.seconds),
              "validation": {"sequences": len(val), "history": log.val, "best_step": log.best_step},
              "learning_curve": log.curve,
              "loss_first": round(log.mean(True), 4), "loss_last": round(log.mean(False), 4),
              "heldout_untrained": before, "heldout_trained": after,
              "config": cfg, "args": {k: v for k, v in vars(args).items() if k != "ckpt"},
              "command": "OMP_NUM_THREADS=1 python scripts/train_medusa.py " + shlex.join(argv)}
    if prior is not None:
        result = chain(result, prior, os.path.relpath(args.out), args.init_from)
    (Path(args.out) / "train_result.json").write_text(json.dumps(result, indent=2) + "\n")
    if not args.smoke:
        write_card(Path(args.out), result, cfg, args)
    print(f"wrote {args.out} [{time.time() - t0:.0f} s]")
    return result


def write_card(folder: Path, r: dict, cfg: dict, args) -> None:
    a, b = r["heldout_trained"], r["heldout_untrained"]
    rows = "\n".join(f"| {i} | token t+{i + 2} | {b['top1'][i]:.3f} | {a['top1'][i]:.3f} | {a['conditional'][i]:.3f} |"
                     for i in range(cfg["num_heads"]))
    d, v = r["data"], r["validation"]
    vocab = (f"a draft vocabulary of the {r['draft_vocab']} most frequent target tokens of the corpus (stored as "
             f"`draft_vocab`, int64; it holds {r['draft_vocab_heldout_coverage']:.1%} of the held-out target tokens), "
             f"so each head multiplies by {r['draft_vocab']} rows of the lm_head instead of {cfg['vocab_size']}"
             if r.get("draft_vocab") else "the full vocabulary")
    curve = ", ".join(f"{p['positions']:,}: {p['first']:.2f}" for p in r["learning_curve"])
    text = f"""# smollm2-medusa: Medusa heads for SmolLM2-135M-Instruct

{cfg['num_heads']} Medusa heads (Cai et al. 2024) for `smollm2-135m`, used by
`SpecConfig(method="medusa")` (`lab_utils/speculative/medusa.py`). Head i is a residual block `h + SiLU(W_i h + b_i)` on
the target's final-norm hidden state at position t, followed by the target's own tied lm_head (not stored here)
over {vocab}; it guesses token t+2+i. Weights: `model.safetensors` (fp16, {r['parameters']:,} parameters),
config: `{CONFIG_NAME}` (named so the model registry does not mistake this folder for a full model).

## Training
- Target frozen; labels are the target's own greedy tokens at each position (self-distillation).
- Corpus: {describe(d)}
{runs_line(r)}- {r['steps']} AdamW steps, batch {r['batch']} positions ({r['positions_seen']:,} positions seen), lr cosine from
  {args.lr:g} (over {args.steps} steps or {args.max_minutes:g} min, whichever ends first), loss = sum_i 0.8^i CE_i over
  the draft vocabulary; {r['seconds']} s on {r['args'].get('machine', 'one core of a 2-core x86_64 CPU VM')}
  (resumable checkpoints).
- Early stopping: {v['sequences']} of the generated training sequences are kept out for validation (mean accepted
  chain length, checked every {args.val_every:g} min); the weights of step {v['best_step']} are shipped.
- Learning curve (`learning_curve` in `train_result.json`; held-out head-0 top-1 by positions seen): {curve}.
- Loss (mean of first / last 20 steps): {r['loss_first']:.3f} -> {r['loss_last']:.3f}.

## Held-out agreement with the target's greedy token
{a['positions']} positions in the target's held-out generated answers (not the prompts) where its greedy continuation is known. top-1 = head i's argmax equals the target's greedy token;
conditional = the same, among positions where heads 0..i-1 were all right (what chain verification accepts).

| head | predicts | top-1 {start_label(r, 'untrained (identity)')} | top-1 trained | conditional |
|---|---|---|---|---|
{rows}

Mean accepted draft tokens per step (greedy chain of {cfg['num_heads']}): {b['mean_accepted']:.2f} {start_label(r)} -> **{a['mean_accepted']:.2f}** trained.

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
