"""The frozen target inside the training loop: for one row it computes the hidden states of the tapped
layers at every position and the target's own next-token choice at every response position (with its
own final norm and LM head). Nothing is written to disk; the trainer may keep them in memory."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specstand.runner import TargetRunner
from specstand.runner.transformer import DecoderModel


@dataclass
class RowFeatures:
    tokens: torch.Tensor  # [T] prompt + response
    taps: dict[int, torch.Tensor]  # layer -> [T, H] bf16
    final: torch.Tensor  # [T, H] bf16, the target's final normed hidden state
    next_label: torch.Tensor  # [T] the target's argmax at p (its guess of token p+1); -1 unless p+1 is a response token

    def __len__(self) -> int:
        return len(self.tokens)


class TargetFeatures:
    """Computes row features once per row and keeps them in memory, for every drafter trained in this
    process: tap the union of the layers they read."""

    def __init__(self, target: DecoderModel, tap_layers: list[int], max_len: int) -> None:
        self.target = target
        self.tap_layers = tuple(sorted(set(tap_layers)))
        self.final_layer = target.shape.num_layers
        self.runner = TargetRunner(target, 1, max_len)
        self._rows: dict[tuple[tuple[int, ...], tuple[int, ...]], RowFeatures] = {}

    def row(self, prompt_ids: list[int], response_ids: list[int]) -> RowFeatures:
        """The row's features, computed on first use. Keyed by the row's tokens, not by its place in a
        list: trainings that share this object may train on different rows (data fractions, datasets)."""
        key = (tuple(prompt_ids), tuple(response_ids))
        if key not in self._rows:
            self._rows[key] = self(prompt_ids, response_ids)
        return self._rows[key]

    @torch.inference_mode()
    def __call__(self, prompt_ids: list[int], response_ids: list[int]) -> RowFeatures:
        tokens = (prompt_ids + response_ids)[: self.runner.capacity]
        cache = self.runner.cache
        cache.release(0)
        cache.allocate(0)
        layers = tuple(sorted({*self.tap_layers, self.final_layer}))
        taps = self.runner.prefill(0, tokens, layers).taps
        final = taps[self.final_layer]
        next_label = torch.full((len(tokens),), -1)
        first = len(prompt_ids) - 1  # the position whose logits chose the first response token
        if first < len(tokens) - 1:
            logits = F.linear(final[first:-1].to(self.target.weights.lm_head.dtype), self.target.weights.lm_head)
            next_label[first:-1] = logits.argmax(-1)
        return RowFeatures(
            tokens=torch.tensor(tokens),
            taps={layer: taps[layer].to(torch.bfloat16) for layer in self.tap_layers},
            final=final.to(torch.bfloat16),
            next_label=next_label,
        )


@dataclass
class Pack:
    """Rows concatenated into one training sequence; attention never crosses a row (docs)."""

    tokens: torch.Tensor
    positions: torch.Tensor  # restart at 0 for every row
    docs: torch.Tensor
    taps: torch.Tensor
    final: torch.Tensor
    next_label: torch.Tensor


def pack_rows(rows: list[RowFeatures], tap_layers: list[int]) -> Pack:
    """Concatenate rows; a row's taps become [T, len(tap_layers) * H] in the drafter's layer order."""
    return Pack(
        tokens=torch.cat([r.tokens for r in rows]),
        positions=torch.cat([torch.arange(len(r)) for r in rows]),
        docs=torch.cat([torch.full((len(r),), i) for i, r in enumerate(rows)]),
        taps=torch.cat([torch.cat([r.taps[layer] for layer in tap_layers], dim=-1) for r in rows]).float(),
        final=torch.cat([r.final for r in rows]).float(),
        next_label=torch.cat([r.next_label for r in rows]),
    )


def plan_packs(lengths: list[int], pack_tokens: int, order: list[int]) -> list[list[int]]:
    """Group row indices (in `order`) into packs of at most `pack_tokens` tokens (a longer row alone)."""
    packs: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index in order:
        if current and used + lengths[index] > pack_tokens:
            packs.append(current)
            current, used = [], 0
        current.append(index)
        used += lengths[index]
    if current:
        packs.append(current)
    return packs
