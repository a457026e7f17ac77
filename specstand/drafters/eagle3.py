"""EAGLE-3: target hidden states of an early, a middle and a late layer, fused 3H -> H by `fc`, one decoder
layer (chain.py), its own LM head over a draft vocabulary of frequent response tokens. Trained with the
training-time test (its own outputs fed back) against the target's distribution over the draft vocabulary.
Drafts token by token."""

from __future__ import annotations

import torch

from specstand.drafters.base import MethodSpec, TrainedParts
from specstand.drafters.chain import ChainDrafter, ChainModel
from specstand.drafters.nn import DrafterSpec
from specstand.drafters.target_parts import TargetParts


def eagle3_tap_layers(num_layers: int) -> list[int]:
    """EAGLE's choice {2, L//2, L-3} (HF numbering: the input of that layer)."""
    return sorted({min(2, num_layers), num_layers // 2, max(num_layers - 3, 0)})


def build_eagle3(spec: DrafterSpec, target: TargetParts, draft_to_target: torch.Tensor) -> ChainModel:
    return ChainModel(spec, target, draft_to_target, trainable_head=True)


def eagle3_drafter(model: ChainModel) -> ChainDrafter:
    return ChainDrafter(model, "eagle3")


METHOD = MethodSpec("eagle3", "EAGLE-3: one layer on three target layers' states",
                    trained=TrainedParts(eagle3_tap_layers, build_eagle3, eagle3_drafter), vllm_names=("eagle3",),
                    needs=("hidden states",))
