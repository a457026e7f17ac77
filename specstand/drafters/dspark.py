"""DSpark: DFlash's block drafter plus a Markov head and a confidence head.

One drafter pass gives every draft row's hidden state h_k and unary logits. The Markov head then makes
the positions depend on each other at almost no cost: position k's logits get a low-rank bias
W2 · W1[prev], prev being the token chosen at k-1 (the anchor for the first position), and the block is
walked in order: argmax when greedy, a draw from softmax(logits / T) when sampling (that q goes to the
lossless rejection rule). The confidence head, Linear([h_k; W1[prev]]) -> 1, predicts "this position will
be accepted"; adaptive verification reads it as a calibrated logit.

The block follows DSpark's `sample_from_anchor` layout by default: the anchor row makes the first draft
(row k predicts position p+k+1), so a block of B rows gives B drafts.

W1 is indexed by draft ids here, with one shared row for every token outside the draft vocabulary (a
previous token can be any target token); the speculators export spreads it over the verifier's vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from specstand.drafters.base import Draft, MethodSpec, TrainedParts
from specstand.drafters.dflash import DFlashDrafter, DFlashModel, dflash_tap_layers
from specstand.drafters.nn import DrafterSpec, draw_drafts
from specstand.drafters.target_parts import TargetParts


def draft_rows_of(draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Target id -> row of a draft-vocabulary table with one extra last row shared by the other tokens."""
    rows = torch.full((vocab_size,), len(draft_to_target))
    rows[draft_to_target] = torch.arange(len(draft_to_target))
    return rows


class MarkovHead(nn.Module):
    """Logit bias W2 · W1[prev] (rank r). W2 starts at zero: an untrained head is plain DFlash."""

    def __init__(self, draft_vocab: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(draft_vocab + 1, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        nn.init.zeros_(self.markov_w2.weight)

    def forward(self, prev_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bias [..., draft vocab], embedding [..., r]) for previous tokens given as table rows."""
        embedding = self.markov_w1(prev_rows)
        return self.markov_w2(embedding), embedding


class ConfidenceHead(nn.Module):
    def __init__(self, inputs: int) -> None:
        super().__init__()
        self.proj = nn.Linear(inputs, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkModel(DFlashModel):
    def __init__(self, spec: DrafterSpec, target: TargetParts, draft_to_target: torch.Tensor) -> None:
        super().__init__(spec, target, draft_to_target)
        if spec.markov_rank < 1:
            raise ValueError("a DSpark drafter needs markov_rank >= 1")
        self.markov_head = MarkovHead(spec.draft_vocab_size, spec.markov_rank)
        inputs = spec.hidden_size + (spec.markov_rank if spec.confidence_head_with_markov else 0)
        self.confidence_head = ConfidenceHead(inputs) if spec.enable_confidence_head else None
        self.register_buffer("prev_rows", draft_rows_of(draft_to_target, spec.target_vocab_size), persistent=False)

    def position_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Markov-corrected logits [..., draft vocab] and the Markov embeddings [..., r] of draft rows
        `hidden` [..., H] whose previous tokens (target ids) are `prev_tokens` [...]."""
        bias, embedding = self.markov_head(self.prev_rows[prev_tokens])
        return self.target.head(hidden) + bias, embedding

    def confidence(self, hidden: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor | None:
        """Acceptance logits [...] of draft rows, None without a confidence head."""
        if self.confidence_head is None:
            return None
        features = torch.cat([hidden, embedding], -1) if self.spec.confidence_head_with_markov else hidden
        return self.confidence_head(features)

    @torch.no_grad()
    def draft(self, hidden: torch.Tensor, anchor: int, temperature: float, generator: torch.Generator) -> Draft:
        unary = self.target.head(hidden)  # one matmul for the block; the walk adds the rank-r biases
        prev = torch.tensor(anchor)
        tokens, probs, confidence = [], [], []
        for k in range(len(hidden)):
            bias, embedding = self.markov_head(self.prev_rows[prev])
            logits = unary[k] + bias
            if temperature > 0:
                drawn, q = draw_drafts(logits[None], temperature, generator, self.d2t, self.spec.target_vocab_size)
                choice = int(drawn[0])
                probs.append(q[0])
            else:
                choice = int(logits.argmax())
            prev = self.d2t[choice]
            tokens.append(int(prev))
            head = self.confidence(hidden[k], embedding)
            if head is None:  # no head: the logit margin, as DFlash
                top2 = logits.topk(2).values
                head = top2[0] - top2[1]
            confidence.append(float(head))
        return Draft(tokens, torch.stack(probs) if probs else None, confidence,
                     calibrated=self.confidence_head is not None)


METHOD = MethodSpec("dspark", "DFlash with a Markov head and a confidence head",
                    trained=TrainedParts(dflash_tap_layers, DSparkModel, DFlashDrafter), block=True,
                    vllm_names=("dspark",), needs=("hidden states",))
