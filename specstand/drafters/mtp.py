"""MTP head, FastMTP style: one layer (chain.py) reading the target's final hidden state and the next
token's embedding, run k times feeding its own output. The LM head is the target's (frozen) over a
compressed draft vocabulary. Trained unrolled over k steps with shared weights and decaying step weights."""

from __future__ import annotations

import torch

from specstand.drafters.base import MethodSpec, TrainedParts
from specstand.drafters.chain import ChainDrafter, ChainModel
from specstand.drafters.nn import DrafterSpec
from specstand.drafters.target_parts import TargetParts


def mtp_tap_layers(num_layers: int) -> list[int]:
    return [num_layers]  # the final normed hidden state, the one the target's head reads


def build_mtp(spec: DrafterSpec, target: TargetParts, draft_to_target: torch.Tensor) -> ChainModel:
    return ChainModel(spec, target, draft_to_target, trainable_head=False)


def mtp_drafter(model: ChainModel) -> ChainDrafter:
    return ChainDrafter(model, "mtp")


METHOD = MethodSpec("mtp", "one chain layer on the target's last hidden state",
                    trained=TrainedParts(mtp_tap_layers, build_mtp, mtp_drafter), vllm_names=("mtp", "deepseek_mtp"),
                    needs=("hidden states",))
