"""Training and held-out evaluation of Medusa heads and the EAGLE head on cached target features.

The target model is frozen: only the heads learn. Labels are the target's own greedy tokens (see
`heads_data.py`), so "accuracy" here means "agrees with what the target would have generated".
Training is bounded by steps AND wall time (a CPU shared with other jobs), with a cosine learning-rate decay.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from lab_utils.speculative.eagle import EagleHead, draft_chain
from lab_utils.speculative.training.data import Sequence
from lab_utils.speculative.medusa import MedusaHeads, VocabHead


@dataclass
class TrainLog:
    steps: int = 0
    positions: int = 0           # training positions seen (a position = one hidden state and its labels)
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)   # per step
    val: list[tuple[int, float]] = field(default_factory=list)  # (step, validation score) at each check
    best_step: int | None = None                         # the step whose weights were kept
    curve: list[dict] = field(default_factory=list)      # held-out acceptance vs positions seen (learning curve)

    def mean(self, first: bool, n: int = 20) -> float:
        xs = self.losses[:n] if first else self.losses[-n:]
        return sum(xs) / max(len(xs), 1)


class VocabSubset:
    """Sampled softmax for training on a CPU: the cross-entropy runs over every token that is ever a label plus
    `extra` random other tokens redrawn each step, instead of all 49k rows of the lm_head (~5x cheaper). The
    random negatives keep pushing the rest of the vocabulary down; evaluation always uses the full lm_head."""

    def __init__(self, labels: torch.Tensor, vocab_size: int, extra: int = 2048) -> None:
        self.always = torch.unique(labels[labels >= 0])
        self.vocab_size, self.extra = vocab_size, extra
        self.others = torch.ones(vocab_size, dtype=torch.bool)
        self.others[self.always] = False
        self.others = self.others.nonzero().squeeze(-1)

    def draw(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids of this step's rows, map [vocab] -> row or -100)."""
        pick = self.others[torch.randperm(len(self.others), generator=g)[: self.extra]]
        rows = torch.cat([self.always, pick])
        remap = torch.full((self.vocab_size,), -100, dtype=torch.long)
        remap[rows] = torch.arange(len(rows))
        return rows, remap


class DraftVocabCE:
    """Cross-entropy over a fixed draft vocabulary (the head's `vocab`): exactly what the head scores when serving.
    Labels outside it are ignored (the head can never propose them)."""

    def __init__(self, vocab: torch.Tensor, vocab_size: int) -> None:
        self.rows = vocab
        self.remap = torch.full((vocab_size,), -100, dtype=torch.long)
        self.remap[vocab] = torch.arange(len(vocab))

    def draw(self, g: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows, self.remap


def subset_ce(feats: torch.Tensor, lm_weight: torch.Tensor, labels: torch.Tensor, sub) -> torch.Tensor:
    """CE of logits = feats @ W.T over the full vocabulary (sub None) or over a VocabSubset draw (rows, remap)."""
    if sub is None:
        return F.cross_entropy(feats @ lm_weight.T, labels, ignore_index=-100)
    rows, remap = sub
    lab = torch.where(labels >= 0, remap[labels.clamp(min=0)], labels)
    return F.cross_entropy(feats @ lm_weight[rows].T, lab, ignore_index=-100)


class KeepBest:
    """Early stopping on a validation split (never the held-out set): every `every_s` seconds score the module,
    keep a copy of the best weights, and put them back at the end. Small data overfits fast on a CPU budget."""

    def __init__(self, module: torch.nn.Module, score_fn, every_s: float, log, tag: str, curve_fn=None) -> None:
        self.module, self.score_fn, self.every_s, self.log, self.tag = module, score_fn, every_s, log, tag
        self.curve_fn = curve_fn   # () -> dict of held-out figures, logged at every check (the learning curve)
        self.best, self.state, self.next_t = float("-inf"), None, every_s

    def check(self, out: TrainLog, force: bool = False) -> None:
        done = bool(out.val) and out.val[-1][0] == out.steps   # this step was scored already
        if self.score_fn is None or done or (not force and out.seconds < self.next_t):
            return
        self.next_t = out.seconds + self.every_s
        self.module.eval()
        score = float(self.score_fn())
        if self.curve_fn is not None:
            point = {"step": out.steps, "positions": out.positions, "seconds": round(out.seconds), **self.curve_fn()}
            out.curve.append(point)
            self.log(f"[{self.tag}] held-out {point}")
        self.module.train()
        out.val.append((out.steps, round(score, 4)))
        if score > self.best:
            self.best, out.best_step = score, out.steps
            self.state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        self.log(f"[{self.tag}] validation {score:.3f} at step {out.steps} (best {self.best:.3f} at {out.best_step})")

    def restore(self) -> None:
        if self.state is not None:
            self.module.load_state_dict(self.state)


class Checkpoint:
    """Resumable training: module, optimizer, RNG, log and best-so-far saved every `every_s` seconds to `path`
    (None: no checkpoints). A run started again with the same arguments continues where the file left off."""

    def __init__(self, path: str | Path | None, every_s: float = 300.0) -> None:
        self.path, self.every_s, self.last = (Path(path) if path else None), every_s, time.time()

    def resume(self, module, opt, g: torch.Generator, out: TrainLog, keep: KeepBest, log) -> int:
        """Load the checkpoint if there is one; returns the step to start from."""
        if self.path is None or not self.path.exists():
            return 0
        ck = torch.load(self.path, weights_only=False)
        module.load_state_dict(ck["module"])
        opt.load_state_dict(ck["opt"])
        g.set_state(ck["rng"])
        for k, v in ck["log"].items():
            setattr(out, k, v)
        keep.best, keep.state, keep.next_t = ck["best"], ck["best_state"], ck["next_t"]
        log(f"resumed from {self.path} at step {out.steps} ({out.positions} positions, {out.seconds:.0f} s)")
        return out.steps

    def maybe_save(self, module, opt, g: torch.Generator, out: TrainLog, keep: KeepBest, force: bool = False) -> None:
        if self.path is None or (not force and time.time() - self.last < self.every_s):
            return
        self.last = time.time()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        torch.save({"module": module.state_dict(), "opt": opt.state_dict(), "rng": g.get_state(), "log": asdict(out),
                    "best": keep.best, "best_state": keep.state, "next_t": keep.next_t}, tmp)
        tmp.replace(self.path)


def _lr(step: int, total: int, base: float, elapsed: float = 0.0, max_seconds: float = 1e9,
        warmup: int = 20) -> float:
    """Linear warmup, then cosine decay over the run's progress: steps done or time used, whichever is further
    (so a run cut short by its time budget still ends at a low learning rate)."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = max((step - warmup) / max(1, total - warmup), elapsed / max_seconds)
    return base * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


# ----------------------------------------------------------------------------------------------------------------
# Medusa
# ----------------------------------------------------------------------------------------------------------------
def medusa_table(seqs: list[Sequence], num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [N, H] fp16, labels [N, K]): head i at position t must give greedy[t + 1 + i] (token t + 2 + i)."""
    hs, labels = [], []
    for s in seqs:
        T = len(s.ids)
        lab = torch.full((T, num_heads), -100, dtype=torch.long)
        for i in range(num_heads):
            if T - 1 - i > 0:
                lab[: T - 1 - i, i] = s.greedy[1 + i:]
        hs.append(s.hidden)
        labels.append(lab)
    return torch.cat(hs), torch.cat(labels)


def medusa_loss(heads: MedusaHeads, lm_head, h: torch.Tensor, labels: torch.Tensor, decay: float = 0.8, sub=None):
    """Sum over heads of decay**i * cross-entropy (Medusa's weighting: later heads are harder, count less)."""
    feats = heads(h)                                   # [K, B, H]
    losses = []
    for i in range(heads.num_heads):
        losses.append(subset_ce(feats[i], lm_head.weight, labels[:, i], sub))
    total = sum(decay ** i * l for i, l in enumerate(losses))
    return total, [l.item() for l in losses]


def _vocab_ce(vocab: torch.Tensor | None, labels: torch.Tensor, vocab_size: int, sampled_vocab: int | None, log,
              tag: str):
    """The training CE's rows: the head's fixed draft vocabulary, else a VocabSubset draw, else the full lm_head."""
    if vocab is not None:
        log(f"[{tag}] CE over the draft vocabulary of {len(vocab)} tokens")
        return DraftVocabCE(vocab, vocab_size)
    if sampled_vocab is not None:
        vs = VocabSubset(labels, vocab_size, sampled_vocab)
        log(f"[{tag}] sampled softmax over {len(vs.always)} label tokens + {sampled_vocab} random others")
        return vs
    return None


def train_medusa(heads: MedusaHeads, target, seqs: list[Sequence], steps: int, batch: int = 256, lr: float = 1e-3,
                 max_seconds: float = 1e9, seed: int = 0, log=print, log_every: int = 10,
                 sampled_vocab: int | None = None, val: list[Sequence] | None = None,
                 val_every_s: float = 120.0, curve=None, ckpt: str | Path | None = None,
                 ckpt_every_s: float = 300.0) -> TrainLog:
    """`sampled_vocab`: None = full-vocabulary CE; n = label tokens + n random others per step (VocabSubset);
    ignored when the heads have a draft vocabulary (`heads.vocab`: CE over exactly it).
    `val`: sequences for early stopping (mean accepted length of the chain), checked every `val_every_s`;
    `curve`: () -> dict of held-out figures logged at each check; `ckpt`: a resumable checkpoint file."""
    g = torch.Generator().manual_seed(seed)
    H, L = medusa_table(seqs, heads.num_heads)
    keep = KeepBest(heads, (lambda: eval_medusa(heads, target, val, limit=200)["mean_accepted"]) if val else None,
                    val_every_s, log, "medusa", curve)
    vs = _vocab_ce(heads.vocab, L, target.config.vocab_size, sampled_vocab, log, "medusa")
    for p in target.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    out, ck = TrainLog(), Checkpoint(ckpt, ckpt_every_s)
    start = ck.resume(heads, opt, g, out, keep, log)
    t0 = time.time() - out.seconds
    heads.train()
    for step in range(start, steps):
        for grp in opt.param_groups:
            grp["lr"] = _lr(step, steps, lr, time.time() - t0, max_seconds)
        idx = torch.randint(0, len(H), (batch,), generator=g)
        loss, per = medusa_loss(heads, target.lm_head, H[idx].float(), L[idx], sub=vs.draw(g) if vs else None)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        out.losses.append(loss.item())
        out.steps, out.positions, out.seconds = step + 1, out.positions + batch, time.time() - t0
        if step % log_every == 0 or step == steps - 1:
            log(f"[medusa] step {step} loss {loss.item():.3f} per-head {[round(x, 2) for x in per]} "
                f"({out.seconds:.0f} s)")
        keep.check(out)
        ck.maybe_save(heads, opt, g, out, keep)
        if out.seconds > max_seconds:
            log(f"[medusa] time budget reached after {step + 1} steps")
            break
    keep.check(out, force=True)
    ck.maybe_save(heads, opt, g, out, keep, force=True)
    keep.restore()
    heads.eval()
    return out


# ----------------------------------------------------------------------------------------------------------------
# EAGLE
# ----------------------------------------------------------------------------------------------------------------
def eagle_batch(seqs: list[Sequence], batch: int, length: int, g: torch.Generator):
    """Random crops: inputs (f_t, x_{t+1}), targets (f_{t+1}, greedy_{t+1}) for t in a crop of `length`."""
    ok = [s for s in seqs if len(s.ids) >= length + 2]
    feats, toks, tf, tl = [], [], [], []
    for j in torch.randint(0, len(ok), (batch,), generator=g).tolist():
        s = ok[j]
        a = int(torch.randint(0, len(s.ids) - length - 1, (1,), generator=g))
        feats.append(s.hidden[a: a + length])
        toks.append(s.ids[a + 1: a + 1 + length])
        tf.append(s.hidden[a + 1: a + 1 + length])
        tl.append(s.greedy[a + 1: a + 1 + length])
    return (torch.stack(feats).float(), torch.stack(toks), torch.stack(tf).float(), torch.stack(tl))


def eagle_loss(head: EagleHead, target, feats, toks, tfeat, tlab, width: int, noise: float, ce_weight: float,
               unroll: bool, g: torch.Generator | None = None, sub=None):
    """Smooth-L1 on the predicted feature + ce_weight * CE of lm_head(predicted feature) vs the target's token.

    `noise` (uniform, relative to the feature scale) and the `unroll` pass (half the rows fed the head's own
    previous prediction instead of the true feature) teach the head to keep going on its own drafts."""
    emb = target.model.embed_tokens(toks)
    scale = feats.std()
    x = feats + noise * scale * (torch.rand(feats.shape, generator=g) - 0.5) if noise else feats
    pred = head(x, emb, width)
    reg = F.smooth_l1_loss(pred, tfeat)
    W = target.lm_head.weight
    ce = subset_ce(pred.flatten(0, 1), W, tlab.flatten(), sub)
    loss = reg + ce_weight * ce
    parts = {"reg": reg.item(), "ce": ce.item()}
    if unroll:
        mine = torch.cat([feats[:, :1], pred[:, :-1]], dim=1)           # row t+1 gets the prediction of f_{t+1}
        mask = (torch.rand(feats.shape[:2], generator=g) < 0.5).unsqueeze(-1)
        mask[:, 0] = False
        pred2 = head(torch.where(mask, mine, feats), emb, width)
        reg2 = F.smooth_l1_loss(pred2, tfeat)
        ce2 = subset_ce(pred2.flatten(0, 1), W, tlab.flatten(), sub)
        loss = loss + reg2 + ce_weight * ce2
        parts.update(reg2=reg2.item(), ce2=ce2.item())
    return loss, parts


def init_eagle(head: EagleHead) -> EagleHead:
    """Start as 'the next feature is the current one': fc = [I, 0], and the layer's output projections at zero
    (a residual block that adds nothing yet)."""
    H = head.cfg.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :H] = torch.eye(H)
        head.fc.weight[:, H:].normal_(0, 0.01)
        head.fc.bias.zero_()
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()
    return head


def train_eagle(head: EagleHead, target, seqs: list[Sequence], steps: int, batch: int = 8, length: int = 32,
                lr: float = 1e-3, ce_weight: float = 0.5, noise: float = 0.2, unroll: bool = True,
                max_seconds: float = 1e9, seed: int = 0, log=print, log_every: int = 10,
                sampled_vocab: int | None = None, val: list[Sequence] | None = None,
                val_every_s: float = 120.0, weight_decay: float = 0.0, curve=None, ckpt: str | Path | None = None,
                ckpt_every_s: float = 300.0) -> TrainLog:
    """`sampled_vocab`: None = full-vocabulary CE; n = label tokens + n random others per step (VocabSubset);
    ignored when the head has a draft vocabulary (`head.vocab`: CE over exactly it).
    `val`: sequences for early stopping (mean accepted length, 4 draft steps), checked every `val_every_s`;
    `curve`: () -> dict of held-out figures logged at each check; `ckpt`: a resumable checkpoint file."""
    g = torch.Generator().manual_seed(seed)
    keep = KeepBest(head, (lambda: eval_eagle(head, target, val, 4, n_rows=head.window, limit=200)["mean_accepted"])
                    if val else None, val_every_s, log, "eagle", curve)
    vs = _vocab_ce(head.vocab, torch.cat([s.greedy for s in seqs]), target.config.vocab_size, sampled_vocab, log,
                   "eagle")
    for p in target.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    out, ck = TrainLog(), Checkpoint(ckpt, ckpt_every_s)
    start = ck.resume(head, opt, g, out, keep, log)
    t0 = time.time() - out.seconds
    head.train()
    for step in range(start, steps):
        for grp in opt.param_groups:
            grp["lr"] = _lr(step, steps, lr, time.time() - t0, max_seconds)
        width = int(torch.randint(1, head.window + 1, (1,), generator=g))
        loss, parts = eagle_loss(head, target, *eagle_batch(seqs, batch, length, g), width, noise, ce_weight,
                                 unroll, g, vs.draw(g) if vs else None)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        out.losses.append(loss.item())
        out.steps, out.positions, out.seconds = step + 1, out.positions + batch * length, time.time() - t0
        if step % log_every == 0 or step == steps - 1:
            log(f"[eagle] step {step} loss {loss.item():.3f} {({k: round(v, 3) for k, v in parts.items()})} "
                f"width {width} ({out.seconds:.0f} s)")
        keep.check(out)
        ck.maybe_save(head, opt, g, out, keep)
        if out.seconds > max_seconds:
            log(f"[eagle] time budget reached after {step + 1} steps")
            break
    keep.check(out, force=True)
    ck.maybe_save(head, opt, g, out, keep, force=True)
    keep.restore()
    head.eval()
    return out


# ----------------------------------------------------------------------------------------------------------------
# Held-out evaluation: does the draft agree with the target's greedy continuation?
# ----------------------------------------------------------------------------------------------------------------
def greedy_positions(seqs: list[Sequence], k: int, min_ctx: int = 4, limit: int = 400, seed: int = 0,
                     starts: list[int] | None = None):
    """(seq index, t) where the text after t follows the target's greedy choice for k + 1 tokens, so the
    target's greedy continuation from t is known: ids[t + 2 + s] for draft step s.

    `starts[i]`: the first generated position of sequence i; only t >= starts[i] - 1 count (the engine's first
    proposal uses the last prompt row). Without it, prompt positions count too, and a chat template's fixed
    system prompt (which the target, and a head, predict perfectly) inflates the score."""
    pos = []
    for si, s in enumerate(seqs):
        T = len(s.ids)
        follows = s.greedy[:-1] == s.ids[1:]                           # follows[u]: ids[u+1] is greedy
        first = max(min_ctx, starts[si] - 1) if starts is not None else min_ctx
        for t in range(first, T - k - 2):
            if bool(follows[t + 1: t + 2 + k].all()):
                pos.append((si, t))
    g = torch.Generator().manual_seed(seed)
    keep = torch.randperm(len(pos), generator=g)[:limit].tolist()
    return [pos[i] for i in sorted(keep)]


def acceptance_summary(correct: torch.Tensor) -> dict:
    """correct [N, k] bool -> per-step top-1 accuracy, conditional acceptance, mean accepted length."""
    lead = correct.long().cumprod(dim=1)                               # 1 while every earlier step was right
    k = correct.shape[1]
    cond = []
    for s in range(k):
        prev = lead[:, s - 1].bool() if s else torch.ones(len(correct), dtype=torch.bool)
        cond.append(float(correct[prev, s].float().mean()) if prev.any() else float("nan"))
    return {"top1": [round(float(correct[:, s].float().mean()), 4) for s in range(k)],
            "conditional": [round(c, 4) for c in cond],
            "mean_accepted": round(float(lead.sum(1).float().mean()), 3), "positions": len(correct)}


@torch.no_grad()
def eval_medusa(heads: MedusaHeads, target, seqs: list[Sequence], k: int | None = None, **kw) -> dict:
    """Top-1 / chain acceptance of the heads vs the target's greedy continuation (see greedy_positions)."""
    k = k or heads.num_heads
    pos = greedy_positions(seqs, k, **kw)
    h = torch.stack([seqs[si].hidden[t] for si, t in pos]).to(target.dtype)
    truth = torch.stack([seqs[si].ids[t + 2: t + 2 + k] for si, t in pos])
    lm = VocabHead(target, heads.vocab)
    guess = lm.tokens(lm(heads(h, k)).argmax(-1)).T                    # [N, k]
    return acceptance_summary(guess == truth)


@torch.no_grad()
def eval_eagle(head: EagleHead, target, seqs: list[Sequence], k: int = 4, n_rows: int = 1, **kw) -> dict:
    """Draft k steps from the last `n_rows` true features (n_rows = 1: right after a prefill or a full reject)."""
    pos = [(si, t) for si, t in greedy_positions(seqs, k, min_ctx=max(4, n_rows), **kw)]
    feats = torch.stack([seqs[si].hidden[t - n_rows + 1: t + 1] for si, t in pos]).to(target.dtype)
    toks = torch.stack([seqs[si].ids[t - n_rows + 2: t + 2] for si, t in pos])
    truth = torch.stack([seqs[si].ids[t + 2: t + 2 + k] for si, t in pos])
    guess, _ = draft_chain(head, target, feats, toks, k)
    return acceptance_summary(guess == truth)
