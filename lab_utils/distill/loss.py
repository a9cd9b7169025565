"""Distillation losses (Hinton et al., 2015): match the teacher's temperature-softened distribution.

KL(p_T || q_T) with p_T = softmax(teacher / T), q_T = softmax(student / T), multiplied by T^2 because the
gradient of the softened KL shrinks like 1/T^2; the factor keeps the soft term's pull comparable across
temperatures and against the hard-label cross-entropy it is mixed with (weight `alpha` on the soft term).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _check(T: float, alpha: float) -> None:
    if not T > 0:
        raise ValueError(f"temperature T={T} must be > 0")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} must be in [0, 1] (weight of the soft, distillation term)")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return x.mean()
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1.0)


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, T: float = 2.0, alpha: float = 1.0,
            labels: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """alpha * T^2 * KL(softmax(t/T) || softmax(s/T)) + (1 - alpha) * CE(s, labels), mean over (masked) rows.

    Logits are [..., V]; labels and mask are [...]. Dense teacher logits (the lab's version)."""
    _check(T, alpha)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student {tuple(student_logits.shape)} and teacher {tuple(teacher_logits.shape)} "
                         "logits must have the same shape")
    logp_t = F.log_softmax(teacher_logits.float() / T, dim=-1)
    logq = F.log_softmax(student_logits.float() / T, dim=-1)
    kl = (logp_t.exp() * (logp_t - logq)).sum(-1)
    loss = alpha * T * T * _masked_mean(kl, mask)
    if alpha < 1.0:
        if labels is None:
            raise ValueError("labels are needed when alpha < 1 (the hard-label cross-entropy term)")
        ce = F.cross_entropy(student_logits.float().flatten(0, -2), labels.flatten(), reduction="none")
        loss = loss + (1 - alpha) * _masked_mean(ce.view(labels.shape), mask)
    return loss


def topk_kd_loss(student_logits: torch.Tensor, topk_idx: torch.Tensor, topk_val: torch.Tensor, T: float = 1.0,
                 alpha: float = 1.0, labels: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """`kd_loss` with the teacher kept as its top-k logits ([..., k] indices and values): the teacher's softened
    distribution is renormalised over those k tokens, the student's is over the whole vocabulary."""
    _check(T, alpha)
    logp_t = F.log_softmax(topk_val.float() / T, dim=-1)
    logq = F.log_softmax(student_logits.float() / T, dim=-1).gather(-1, topk_idx.long())
    kl = (logp_t.exp() * (logp_t - logq)).sum(-1)
    loss = alpha * T * T * _masked_mean(kl, mask)
    if alpha < 1.0:
        if labels is None:
            raise ValueError("labels are needed when alpha < 1 (the hard-label cross-entropy term)")
        ce = F.cross_entropy(student_logits.float().flatten(0, -2), labels.flatten().long(), reduction="none")
        loss = loss + (1 - alpha) * _masked_mean(ce.view(labels.shape), mask)
    return loss
