"""Checks for lab 06's exercise: the distillation loss T^2 * KL(softmax(t/T) || softmax(s/T)), mean over rows.

The check runs the learner's function on fresh random logits at several temperatures, compares it with
`lab_utils.distill.loss.kd_loss`, checks that a gradient reaches the student's logits, and when the value is
off, tests the usual mistakes (no T^2, reversed KL, temperature on one side only or not at all, a sum instead
of a mean) to say which one it looks like. It never shows the reference code.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from lab_utils.checks.claims import Claim
from lab_utils.distill.loss import kd_loss

KDLoss = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    lp, lq = F.log_softmax(p_logits, -1), F.log_softmax(q_logits, -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def _mistakes(s: torch.Tensor, t: torch.Tensor, T: float) -> dict[str, torch.Tensor]:
    """What common wrong versions return, to name the one the learner's value matches."""
    return {
        "the T^2 factor is missing (the softened KL's gradients shrink like 1/T^2; multiply by T*T)":
            _kl(t / T, s / T).mean(),
        "the KL is reversed: distillation uses KL(teacher || student) = sum p_t (log p_t - log p_s)":
            T * T * _kl(s / T, t / T).mean(),
        "the temperature is not applied: divide both logits by T before the softmax":
            T * T * _kl(t, s).mean(),
        "only the teacher's logits are divided by T: soften the student's too":
            T * T * _kl(t / T, s).mean(),
        "only the student's logits are divided by T: soften the teacher's too":
            T * T * _kl(t, s / T).mean(),
        "you summed over rows: average the per-row KL over the batch":
            T * T * _kl(t / T, s / T).sum(),
    }


def check_kd_loss(fn: KDLoss, seed: int | None = None) -> None:
    """`fn(student_logits [N, V], teacher_logits [N, V], T) -> scalar tensor`: T^2 * mean_rows KL(p_T || q_T)."""
    gen = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ()).item()))
    # (T, logit scale): moderate logits first, then a real model's range at T < 1, where the probabilities of the
    # lowest logits underflow to 0 in float32 (a trained LM's logits span 30-60; divided by 0.5, more)
    for T, scale in ((1.0, 3.0), (2.0, 3.0), (4.0, 3.0), (0.5, 3.0), (0.5, 40.0)):
        n, v = int(torch.randint(3, 9, (), generator=gen)), int(torch.randint(5, 40, (), generator=gen))
        s = (torch.randn(n, v, generator=gen) * scale).requires_grad_(True)
        t = torch.randn(n, v, generator=gen) * scale
        got = fn(s, t.clone(), T)
        if not isinstance(got, torch.Tensor) or got.numel() != 1:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise AssertionError(f"kd_loss must return a scalar tensor (mean over the {n} rows), got {shape}")
        expected = kd_loss(s.detach(), t, T=T)
        if not torch.isfinite(got.detach()).all():
            span = float(torch.cat([s.detach(), t]).max() - torch.cat([s.detach(), t]).min())
            raise AssertionError(
                f"kd_loss(student [{n}, {v}], teacher [{n}, {v}], T={T}) = {got.item()} for logits spanning "
                f"{span:.0f}, expected {expected.item():.6f}"
                f"\n   it looks like the log of a softmax: softmax(x / T) rounds the probabilities of logits far "
                f"below the largest to 0 in float32, and log(0) = -inf (then 0 * -inf = nan); compute the "
                f"log-probabilities in one step that subtracts the row's maximum (log-softmax)")
        if not torch.allclose(got.detach().float(), expected, rtol=1e-4, atol=1e-5):
            hint = next((why for why, val in _mistakes(s.detach(), t, T).items()
                         if torch.allclose(got.detach().float(), val, rtol=1e-4, atol=1e-5)), "")
            raise AssertionError(
                f"kd_loss(student [{n}, {v}], teacher [{n}, {v}], T={T}) = {got.item():.6f}, expected {expected.item():.6f}"
                + (f"\n   it looks like {hint}" if hint else
                   "\n   the loss is T^2 times the mean over rows of sum_v p_t(v) (log p_t(v) - log p_s(v)), with p_t, p_s "
                   "the softmax of teacher / T and student / T over the vocabulary (the last dimension)")
            )
        if not got.requires_grad:
            raise AssertionError("the loss does not depend on the student's logits through autograd (no .detach(), "
                                 "no .item(), no numpy inside)")
        (g,) = torch.autograd.grad(got, s)
        if not torch.isfinite(g).all() or g.abs().sum() == 0:
            raise AssertionError("the gradient with respect to the student's logits is zero or not finite")
    same = torch.randn(4, 10, generator=gen)
    zero = fn(same.clone().requires_grad_(True), same.clone(), 2.0)
    zero = float(zero.detach()) if isinstance(zero, torch.Tensor) else float(zero)
    if abs(zero) > 1e-5:
        raise AssertionError(f"a student equal to its teacher must have loss 0, got {zero:.3g}")
    print("check_kd_loss: correct at T = 0.5, 1, 2, 4, and at T = 0.5 for logits of a real model's range; zero when "
          "the student equals the teacher; gradients flow ✓")


# --- the lab's closing claims --------------------------------------------------------------------------------


def claims(r: dict) -> list[Claim]:
    """Lab 06's claims from the run's measurements `r` (built in the notebook's claims cell). With a random-weight
    teacher (`model`, the lab's MODEL) agreement and perplexity say nothing of distillation: NOT JUDGED."""
    from lab_utils.checks.claims import need, trained_only

    need(r, "live_losses", "agreement", "draft_params", "teacher_params", "draft_mb", "cost_ratio", "ppl")
    losses, a, ppl = list(r["live_losses"]), r["agreement"], r["ppl"]
    n = max(1, len(losses) // 4)
    first, last = sum(losses[:n]) / n, sum(losses[-n:]) / n
    a_d, a_u = a["draft"], a["untrained"]
    return [
        (f"live distillation: the KD loss falls ({first:.3f} -> {last:.3f}, first vs last quarter of "
         f"{len(losses)} steps)", len(losses) >= 2 and last < first),
        trained_only((f"the distilled draft agrees with the teacher on {a_d:.1%} of held-out generated tokens (>= 12%) "
                      f"and >= 4x an untrained model of the same size ({a_u:.1%})",
                      a_d >= 0.12 and a_d >= 4 * max(a_u, 0.01)), r.get("model")),
        (f"the shipped draft is tiny: {r['draft_params'] / 1e6:.1f} M parameters vs {r['teacher_params'] / 1e6:.0f} M "
         f"(< 1/10), {r['draft_mb']:.1f} MB fp16 (< 20 MB)",
         r["draft_params"] * 10 < r["teacher_params"] and r["draft_mb"] < 20),
        (f"the draft is >= 5x cheaper per decode step at batch 1 (measured {r['cost_ratio']:.1f}x)",
         r["cost_ratio"] >= 5),
        trained_only((f"held-out perplexity: teacher {ppl['teacher']:.1f} < draft {ppl['draft']:.1f} < 1/20 of "
                      f"untrained {ppl['untrained']:,.0f}", ppl["teacher"] < ppl["draft"] < 0.05 * ppl["untrained"]),
                     r.get("model")),
    ]


def assert_claims(r: dict, show: bool = True) -> None:
    """Print lab 06's claims; AssertionError naming each one that fails."""
    from lab_utils.checks.claims import report

    report(claims(r), show)


# every check_* above also records its result in the learner's own log (lab_utils.workshop.records)
from lab_utils.workshop.records import record_checks  # noqa: E402

record_checks(globals())
