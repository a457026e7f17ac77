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


def per_position_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The mean over blocks of each draft position's values ([anchors, D]); NaN where no block reaches a
    position: no data there, which D-PACE's running accuracy skips, rather than an accuracy of 0."""
    count = valid.sum(0)
    return torch.where(count > 0, values.sum(0) / count.clamp_min(1), float("nan"))


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
        q = per_position_mean(torch.exp(-ce) * learnable, valid)
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


def exp_position_weights(positions: int, scale: float = 4.0) -> torch.Tensor:
    """DeepSpec's DSpark weighting: position k (0-based) weighs exp(-k / scale), normalised to mean 1."""
    weights = torch.exp(-torch.arange(positions, dtype=torch.float32) / scale)
    return weights / weights.mean()


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The probability that a token drawn from q is accepted when the target's distribution is p:
    sum over tokens of min(p, q) = 1 - TV(p, q), over the last dimension."""
    return torch.minimum(p, q).sum(-1)


def dspark_loss(logits: torch.Tensor, target_probs: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                position_weights: torch.Tensor, confidence_logits: torch.Tensor | None,
                ce_weight: float = 0.1, l1_weight: float = 0.9, confidence_weight: float = 1.0,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """DSpark's loss as DeepSpec weighs it, per draft position ([anchors, D, V] Markov-corrected logits,
    the target's distribution over the same vocabulary): 0.1 cross-entropy to the target's argmax + 0.9 L1
    distance |p - q| + 1.0 BCE of the confidence head against the analytic acceptance 1 - TV(p, q)
    (computed from q without gradient: the head learns to predict it, the drafter is not pulled towards
    what the head predicts well). Returns the loss and the mean probability of the right token per
    position (for D-PACE)."""
    log_q = F.log_softmax(logits, -1)
    q = log_q.exp()
    learnable = valid & (labels >= 0)
    ce = -log_q.gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1)
    per_position = ce_weight * ce * learnable + l1_weight * (target_probs - q).abs().sum(-1) * valid
    if confidence_logits is not None:
        accepted = acceptance_rate(target_probs, q.detach())
        bce = F.binary_cross_entropy_with_logits(confidence_logits, accepted, reduction="none")
        per_position = per_position + confidence_weight * bce * valid
    weights = position_weights[None, :] * valid
    loss = (per_position * position_weights[None, :]).sum() / weights.sum().clamp_min(1e-9)
    with torch.no_grad():
        q_right = per_position_mean(torch.exp(-ce) * learnable, valid)
    return loss, q_right


def selector_loss(edge_scores: torch.Tensor, target_index: torch.Tensor, learnable: torch.Tensor,
                  position_weights: torch.Tensor) -> torch.Tensor:
    """DFlash 2's ranker loss: cross-entropy of choosing the target's token among the candidates
    ([anchors, D, k] edge scores, the index of the target's token in each row's candidates)."""
    ce = F.cross_entropy(edge_scores.flatten(0, 1), target_index.flatten(), reduction="none").view(target_index.shape)
    weights = position_weights[None, :] * learnable
    return (ce * weights).sum() / weights.sum().clamp_min(1e-9)
