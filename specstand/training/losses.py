"""Training losses of the trained drafters, written out by hand (they are the product)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def target_to_draft(draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """t2d as an index map: target id -> draft id, -1 for tokens outside the draft vocabulary."""
    t2d = torch.full((vocab_size,), -1)
    t2d[draft_to_target] = torch.arange(len(draft_to_target))
    return t2d


def dpace_weights(position_accuracy: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE position weights from per-position probabilities of the right token q_k: smoothed
    a_k = (1 - alpha) q_k + alpha, weight_j = sum over k >= j of prod over i <= k of a_i (the derivative of
    the expected accepted length by log a_j), normalised to mean 1. Early positions weigh more."""
    smoothed = (1 - alpha) * position_accuracy + alpha
    survival = torch.cumprod(smoothed, dim=0)
    weights = torch.flip(torch.cumsum(torch.flip(survival, [0]), 0), [0])
    return weights / weights.mean()


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                position_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of block rows 1..B-1 ([anchors, B-1, V]) against the target's argmax (draft ids),
    weighted per position. Returns the loss and q_k: the mean probability of the right token per position
    (no gradient), which feeds D-PACE. Labels outside the draft vocabulary cannot be learnt: skipped."""
    learnable = valid & (labels >= 0)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.clamp_min(0).flatten(), reduction="none").view(labels.shape)
    weights = position_weights[None, :] * learnable
    loss = (ce * weights).sum() / weights.sum().clamp_min(1e-9)
    with torch.no_grad():
        right = torch.exp(-ce) * learnable
        q = right.sum(0) / valid.sum(0).clamp_min(1)
    return loss, q


def chain_step_loss(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                    target_logits: torch.Tensor | None) -> torch.Tensor:
    """One training-time-test step. With `target_logits` (EAGLE-3): KL from the target's distribution over
    the draft vocabulary (soft cross-entropy minus the target's entropy: 0 when matched); without (MTP):
    cross-entropy to the target's argmax."""
    if target_logits is not None:
        target_log_probs = F.log_softmax(target_logits, -1)
        per_row = (target_log_probs.exp() * (target_log_probs - F.log_softmax(logits, -1))).sum(-1)
        mask = valid
    else:
        mask = valid & (labels >= 0)
        per_row = F.cross_entropy(logits, labels.clamp_min(0), reduction="none")
    return (per_row * mask).sum() / mask.sum().clamp_min(1)
