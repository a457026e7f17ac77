"""What the runner, the engine and the drafters ask of a target model: the one interface the three forwards
(transformer.DecoderModel, hybrid.HybridModel, generic.TransformersModel) share."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from specstand.runner.transformer import ModelShape


class TargetModel(Protocol):
    shape: ModelShape
    weights: Any  # its embedding and head at least (`embed_tokens`, `lm_head`): trained drafters share them
    max_positions: int  # the most positions a cache slot may hold
    compiled: Any  # the compiled decode/verify forward (runner/compiled.py), or None
    kernel_path: str  # what its linears run on, chosen once at load (kernels.chosen_path); "python": torch
    exact_by_design: bool  # rows compute alike whatever shares their pass (the start-up probe confirms)

    def new_cache(self, num_slots: int, capacity: int) -> Any:
        """A cache of `num_slots` slots of `capacity` positions, with O(1) rollback to any shorter length."""

    def forward(self, tokens: torch.Tensor, start_positions: list[int], slots: list[int], cache: Any,
                tap_layers: tuple[int, ...] = (), prefill: bool = False, logits_at: list[int] | None = None,
                real_rows: list[int] | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Rows `tokens` [B, T] at each slot's positions start.. : fp32 logits and the tapped hidden states
        (DecoderModel.forward says it in full)."""
