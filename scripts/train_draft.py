"""Distil SmolLM2-135M-Instruct into a tiny draft model (lab 06, used as lab 07's speculative draft).

    python scripts/train_draft.py --smoke                      # < 1 min: a few steps, shows the loss falling
    python scripts/train_draft.py --stage teacher --minutes 14 # teacher greedy continuations + top-k logits
    python scripts/train_draft.py --stage train --minutes 28   # KD training, writes data/models/smollm2-draft

Teacher targets are cached in $LAB_UTILS_CACHE/distill/ (never committed). Seeds are fixed.
Run with OMP_NUM_THREADS=1 on a shared machine.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from lab_utils.paths import DATA_DIR, cache_dir

TEACHER = "smollm2-135m"
OUT_DIR = DATA_DIR / "models" / "smollm2-draft"
# runs 1 and 2 of data/models/smollm2-draft, on teacher targets (the teacher stage ran beside the training
# stage, which picks up new teacher sequences at every evaluation)
COMMAND = """export PYTHONPATH=$PWD OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
# run 1 (session of 2026-11-30 early): 512 teacher sequences, 330 steps from the PCA initialisation
python scripts/train_draft.py --stage teacher --minutes 18        # held-out targets, then training targets
python scripts/train_draft.py --stage teacher --minutes 29 &      # resumes: more training targets, meanwhile
python scripts/train_draft.py --stage train --minutes 40 --eval-every 50
cp -r data/models/smollm2-draft /tmp/draft_v1
# run 2: more teacher sequences (the teacher now on oneDNN-packed linears), then a warm start;
# while it trained, a third teacher stage added copy ("quote") prompts, picked up at the next evaluation
python scripts/train_draft.py --stage teacher --minutes 25 --train-prompts 6000
python scripts/train_draft.py --stage train --minutes 35 --eval-every 200 --lr 1e-3 --alpha 0.5 \\
    --raw-per-batch 2 --init-from /tmp/draft_v1 &
python scripts/train_draft.py --stage teacher --minutes 7 --train-prompts 600 --mix 0 0 0 1"""
# what made the shipped data/models/smollm2-draft: COMMAND's checkpoint continued twice on the heads' corpus
# (scripts/train_eagle.py builds it; it adds the target's answers to everyday assistant requests)
CORPUS_COMMAND = COMMAND + """
cp -r data/models/smollm2-draft /tmp/draft_v2
# run 3: the heads' corpus with 16 shards of assistant requests, the target's greedy tokens as labels
python scripts/train_eagle.py --gen-shards 12 --fixed-shards 16 --asst-shards 16 --corpus-only
python scripts/train_draft.py --stage train --corpus 12 16 16 --minutes 25 --eval-every 200 --lr 1e-3 \\
    --alpha 1.0 --raw-per-batch 0 --init-from /tmp/draft_v2
cp -r data/models/smollm2-draft /tmp/draft_v3
# run 4 (this checkpoint): 32 shards of assistant requests
python scripts/train_eagle.py --gen-shards 12 --fixed-shards 16 --asst-shards 32 --corpus-only
python scripts/train_draft.py --stage train --corpus 12 16 32 --minutes 20 --eval-every 200 --lr 5e-4 \\
    --alpha 1.0 --raw-per-batch 0 --init-from /tmp/draft_v3"""


def targets_path() -> Path:
    return cache_dir() / "distill" / "teacher_targets.pt"


def stage_teacher(args) -> None:
    from lab_utils.distill.data import make_prompts
    from lab_utils.distill.teacher import generate_targets, load_targets, save_targets
    from lab_utils.models.loader import load_model

    torch.manual_seed(args.seed)
    from lab_utils.engine.accel import fast_linears

    model, tok = load_model(TEACHER, device="cpu")
    model = fast_linears(model, model.device)  # oneDNN-packed linears: ~1.3-2x faster generation on a CPU
    t0 = time.time()
    deadline = t0 + args.minutes * 60
    held = make_prompts(tok, args.heldout_prompts, "heldout", seed=args.seed)
    train = make_prompts(tok, args.train_prompts, "train", seed=args.seed, mix=tuple(args.mix))
    meta = {"teacher": TEACHER, "new_tokens": args.new_tokens, "top_k": args.top_k, "seed": args.seed}
    held_rec, done, spent = None, [], 0.0
    if targets_path().exists():  # resume: keep what an earlier run produced, generate only the rest
        old, old_meta = load_targets(targets_path())
        if all(old_meta.get(k) == v for k, v in meta.items()):
            held_rec, done, spent = old["heldout"], old["train"], old_meta.get("seconds", 0.0)
            print(f"[teacher] resuming: {len(done)} train seqs cached", flush=True)
    if held_rec is None:
        held_rec = generate_targets(model, [p.ids for p in held], args.new_tokens, args.top_k, args.batch)
        print(f"[teacher] held-out: {len(held_rec)} seqs, {sum(len(r['ids']) for r in held_rec)} tokens, "
              f"{time.time() - t0:.0f}s", flush=True)
    seen = {tuple(r["ids"][: r["n_prompt"]].tolist()) for r in done}
    todo = [p.ids for p in train if p.ids not in seen]

    def save(new_rec):
        rec = done + new_rec
        ntok = sum(len(r["ids"]) for r in rec)
        m = dict(meta, n_train=len(rec), train_tokens=ntok, seconds=round(spent + time.time() - t0, 1))
        save_targets({"train": rec, "heldout": held_rec}, targets_path(), m)
        print(f"[teacher] train: {len(rec)} seqs, {ntok} tokens, {time.time() - t0:.0f}s", flush=True)

    save(generate_targets(model, todo, args.new_tokens, args.top_k, args.batch, deadline=deadline, on_batch=save))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=["teacher", "train"], default="train")
    ap.add_argument("--smoke", action="store_true", help="a few steps on a few teacher sequences (< 1 min)")
    ap.add_argument("--minutes", type=float, default=28.0, help="wall budget of the stage")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--train-prompts", type=int, default=4000)
    ap.add_argument("--heldout-prompts", type=int, default=64)
    ap.add_argument("--mix", nargs="+", type=float, default=[0.5, 0.3, 0.2],
                    help="shares of training prompts: chat wiki play [quote] (the teacher stage)")
    ap.add_argument("--steps", type=int, default=0, help="training steps (the LR schedule's length); 0: the schedule "
                    "follows the wall budget --minutes instead")
    ap.add_argument("--train-batch", type=int, default=8, help="teacher sequences per training step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--alpha", type=float, default=0.7, help="weight of the soft KD term (1 - alpha: hard CE)")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--init-from", default=None, help="continue from this draft checkpoint (a folder) instead of "
                    "the PCA initialisation")
    ap.add_argument("--raw-per-batch", type=int, default=3, help="plain-text windows per step (CE, no teacher)")
    ap.add_argument("--raw-texts", type=int, default=4000, help="plain-text windows to draw them from")
    ap.add_argument("--corpus", nargs=3, type=int, default=None, metavar=("GEN", "FIXED", "ASST"),
                    help="train on the heads' corpus (shards of each kind, as scripts/train_eagle.py builds them) "
                    "with the target's greedy tokens as labels, instead of the teacher stage's targets")
    args = ap.parse_args(argv)
    args.command = CORPUS_COMMAND if args.corpus else COMMAND
    torch.set_num_threads(1)
    if args.stage == "teacher" and not args.smoke:
        stage_teacher(args)
    else:
        from lab_utils.distill.train import run_cli

        run_cli(args, targets_path(), OUT_DIR, TEACHER)


if __name__ == "__main__":
    main()
