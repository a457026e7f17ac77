"""Training objectives: what each trained method's drafter is asked to predict, from one pack of rows.

Block methods (dflash, dspark, dflash2) sample anchors in the pack and predict, in one drafter pass,
draft j = 0..D-1 of each block: the token at position a+1+j, which the target chose at row a+j (its
`next_label`). Chain methods (eagle3, mtp) unroll their training-time test over every row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specstand.drafters.chain import ChainModel
from specstand.drafters.dflash import DFlashModel
from specstand.drafters.dflash2 import DFlash2Model
from specstand.drafters.dspark import DSparkModel
from specstand.training.config import TrainConfig
from specstand.training.features import Pack
from specstand.training.losses import (
    chain_step_loss,
    dflash_loss,
    dpace_weights,
    dspark_loss,
    exp_position_weights,
    selector_loss,
)


@dataclass
class BlockBatch:
    """The draft positions of the sampled blocks, [anchors, D] each (hidden: [anchors, D, H])."""

    hidden: torch.Tensor  # the drafter's final hidden states at the draft rows
    labels: torch.Tensor  # the target's token in draft ids, -1 outside the draft vocabulary
    valid: torch.Tensor  # inside the pack, the same document, a response token
    prev: torch.Tensor  # the token before each draft position (target ids; the anchor for j = 0)
    source: torch.Tensor  # the pack row whose target output is each draft position's label


def block_batch(model: DFlashModel, pack: Pack, t2d: torch.Tensor, anchors_wanted: int,
                generator: torch.Generator) -> BlockBatch | None:
    """The sampled blocks, or None where the pack has no anchor (every response a single token)."""
    count, label = len(pack.tokens), pack.next_label
    # an anchor holds an emitted response token (chosen at a-1) with at least one response token after it
    candidates = torch.nonzero((label[:-1] >= 0) & (label[1:] >= 0)).flatten() + 1
    if not len(candidates):
        return None
    anchors = candidates[torch.randperm(len(candidates), generator=generator)[:anchors_wanted]].sort().values
    hidden = model.training_hidden(pack.taps, pack.tokens, pack.positions, pack.docs, anchors)
    source = anchors[:, None] + torch.arange(model.num_drafts)[None]
    inside = source < count
    source = source.clamp_max(count - 1)
    valid = inside & (label[source] >= 0) & (pack.docs[source] == pack.docs[anchors][:, None])
    labels = torch.where(label[source] >= 0, t2d[label[source].clamp_min(0)], -1)
    return BlockBatch(hidden, labels, valid, pack.tokens[source], source)


def zero_loss(model: torch.nn.Module) -> torch.Tensor:
    """The loss of a pack that teaches nothing: 0, yet reaching every trained parameter, as every rank's
    gradients are all-reduced (a loss cut off from them would leave the other ranks waiting)."""
    return sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0


def no_blocks(model: DFlashModel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a pack without an anchor teaches a block drafter: nothing (a zero loss), no accuracy per position
    (NaN: the running one stays as it is) and none accepted."""
    return zero_loss(model), torch.full((model.num_drafts,), float("nan")), torch.zeros(model.num_drafts)


def position_weights(config: TrainConfig, running_q: torch.Tensor) -> torch.Tensor:
    """D-PACE from the running per-position accuracy, or DSpark's exp(-k/4)."""
    if config.weighting == "exp":
        return exp_position_weights(len(running_q))
    return dpace_weights(running_q, config.dpace_alpha)


def accepted_prefix(hits: torch.Tensor) -> torch.Tensor:
    """Share of blocks whose drafts 0..j were all right, per j ([anchors, D] hits)."""
    return torch.cumprod(hits.int(), dim=1).float().mean(0)


def dflash_objective(model: DFlashModel, pack: Pack, t2d: torch.Tensor, config: TrainConfig,
                     generator: torch.Generator, running_q: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss, q per position (for D-PACE) and accepted-prefix rate per position over sampled anchors."""
    batch = block_batch(model, pack, t2d, config.anchors, generator)
    if batch is None:
        return no_blocks(model)
    logits = model.target.head(batch.hidden)
    loss, q = dflash_loss(logits, batch.labels, batch.valid, position_weights(config, running_q))
    return loss, q, accepted_prefix((logits.argmax(-1) == batch.labels) & batch.valid)


def dspark_objective(model: DSparkModel, pack: Pack, t2d: torch.Tensor, config: TrainConfig,
                     generator: torch.Generator, running_q: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DSpark: Markov-corrected logits with the previous token teacher-forced (the target's own token:
    along an accepted prefix that is what the drafter itself chose), the confidence head on detached
    features (a probe of the drafter, not a pull on it)."""
    batch = block_batch(model, pack, t2d, config.anchors, generator)
    if batch is None:
        return no_blocks(model)
    logits, embedding = model.position_logits(batch.hidden, batch.prev)
    with torch.no_grad():  # the target's distribution over the draft vocabulary, as EAGLE-3 distils it
        target_probs = torch.softmax(model.target.head(pack.final[batch.source]), -1)
    confidence = model.confidence(batch.hidden.detach(), embedding.detach())
    loss, q = dspark_loss(logits, target_probs, batch.labels, batch.valid, position_weights(config, running_q),
                          confidence)
    return loss, q, accepted_prefix((logits.argmax(-1) == batch.labels) & batch.valid)


def dflash2_objective(model: DFlash2Model, pack: Pack, t2d: torch.Tensor, config: TrainConfig,
                      generator: torch.Generator, running_q: torch.Tensor,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DFlash 2: the unary loss as DFlash plus `selector_alpha` x the ranker's cross-entropy of picking
    the target's token among the top-k candidates (teacher-forced predecessor); a target token missing
    from the top-k replaces the weakest candidate, so the ranker always has the right answer to learn."""
    batch = block_batch(model, pack, t2d, config.anchors, generator)
    if batch is None:
        return no_blocks(model)
    weights = position_weights(config, running_q)
    unary = model.target.head(batch.hidden)
    loss, q = dflash_loss(unary, batch.labels, batch.valid, weights)
    ids = model.candidates(unary.detach())[1]
    learnable = batch.valid & (batch.labels >= 0)
    missing = learnable & ~(ids == batch.labels[..., None]).any(-1)
    ids[..., -1] = torch.where(missing, batch.labels.clamp_min(0), ids[..., -1])
    edges = model.candidate_selector.edge_scores(unary.gather(-1, ids), ids, batch.hidden, model.prev_rows[batch.prev])
    target_index = (ids == batch.labels[..., None]).int().argmax(-1)
    loss = loss + config.selector_alpha * selector_loss(edges, target_index, learnable, weights)
    chosen = ids.gather(-1, edges.argmax(-1, keepdim=True)).squeeze(-1)
    return loss, q, accepted_prefix((chosen == batch.labels) & batch.valid & ~missing)


BLOCK_OBJECTIVES = {"dflash": dflash_objective, "dspark": dspark_objective, "dflash2": dflash2_objective}


def chain_objective(model: ChainModel, pack: Pack, t2d: torch.Tensor, config: TrainConfig,
                    soft: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss over the unrolled steps and accepted-prefix rate per step (chains anchored at real rows)."""
    steps = model.spec.train_steps
    count = len(pack.tokens)
    index = torch.arange(count)
    source = (index + 1).clamp_max(count - 1)  # row j predicts token j+2, chosen by the target at j+1
    label = torch.where(index + 1 < count, pack.next_label[source], -1)
    labels = torch.where(label >= 0, t2d[label.clamp_min(0)], -1)
    scored = []  # step s scores the rows whose chain, real row j-s+1 to j+1, lies in one document
    for s in range(1, steps + 1):
        anchor = index - s + 1
        valid = (label >= 0) & (anchor >= 0) & (pack.docs[anchor.clamp_min(0)] == pack.docs[source])
        scored.append(torch.nonzero(valid).flatten())
    hidden = model.training_hidden(pack.taps, pack.tokens, pack.positions, pack.docs, scored)
    total, norm = 0.0, 0.0
    hits = torch.zeros(steps, count, dtype=torch.bool)
    for s, rows in enumerate(scored, start=1):
        if not len(rows):
            continue
        logits = model.logits(hidden[s - 1][rows])
        target_logits = model.target.head(pack.final[source[rows]]) if soft else None
        weight = config.decay ** (s - 1)
        total = total + weight * chain_step_loss(logits, labels[rows], torch.ones(len(rows), dtype=torch.bool),
                                                 target_logits)
        norm += weight
        hits[s - 1, rows] = logits.argmax(-1).detach() == labels[rows]
    # chain anchored at real row a: its step s is row a+s-1
    anchors = torch.nonzero(label >= 0).flatten()
    survive = torch.ones(len(anchors), dtype=torch.bool)
    prefix = []
    for s in range(steps):
        at = anchors + s
        survive = survive & (at < count) & hits[s, at.clamp_max(count - 1)]
        prefix.append(survive.float().mean() if len(anchors) else torch.tensor(0.0))
    loss = total / norm if norm else zero_loss(model)
    return loss, torch.stack(prefix)
