"""What trained drafters borrow from the target: its embedding table and LM head (frozen, never saved
with a drafter)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specstand import kernels


class TargetParts(nn.Module):
    """The target's embedding and head, as frozen buffers; `frozen_for` keeps the head rows of a draft
    vocabulary only, in fp32 (the drafter scores draft ids, mapped back through d2t)."""

    def __init__(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("embed_tokens", embed_tokens.detach(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach(), persistent=False)
        self.packed_head = None  # the head on the CPU kernels (inference only: pack_head)

    def frozen_for(self, draft_to_target: torch.Tensor) -> TargetParts:
        return TargetParts(self.embed_tokens, self.lm_head[draft_to_target].float())

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed_tokens).float()

    def pack_head(self, path: str) -> None:
        self.packed_head = kernels.pack(self.lm_head, path)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head) if self.packed_head is None else self.packed_head.forward(hidden)
