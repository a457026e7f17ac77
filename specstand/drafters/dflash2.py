"""DFlash 2: DFlash's block drafter plus grouped dynamic convolutions and a candidate selector.

Convolutions: in every layer, around attention and around the MLP, the sublayer's input and its output
are each mixed with the previous block row by a 2-tap causal convolution,
out[i, c] = sum_t (base[t, c] + delta[i, t, group(c)]) * x[i - t, c], whose per-row deltas (one per
group of 16 channels) come from one projection of the sublayer's (normed) input. Taps never reach across
a block's first row. Initialised as the identity (tap 0 = 1, projection 0): a DFlash layer to begin with.

Selector: each draft row keeps the top-16 of its unary logits; an edge prev -> c scores
unary[c] + <pred[prev] * proj(h), succ[c]> (rank r codebooks); the block is walked from the verified
anchor, greedily or, when sampling, drawing from q = softmax(edge scores / T) over the 16 candidates (q,
scattered onto the vocabulary, goes to the lossless rejection rule).

The codebooks are indexed by draft ids here (the predecessor one with a shared last row for tokens outside
the draft vocabulary); the speculators export spreads them over the verifier's vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specstand.drafters.base import Draft, MethodSpec, TrainedParts
from specstand.drafters.dflash import DFlashDrafter, DFlashModel, dflash_tap_layers
from specstand.drafters.dspark import draft_rows_of
from specstand.drafters.nn import DrafterSpec, draw_drafts
from specstand.drafters.target_parts import TargetParts


class GroupedDynamicConv(nn.Module):
    def __init__(self, hidden: int, taps: int, group: int) -> None:
        super().__init__()
        if hidden % group:
            raise ValueError(f"hidden size {hidden} is not a multiple of the conv group size {group}")
        self.taps, self.group = taps, group
        base = torch.zeros(2, taps, hidden)  # [input side / output side, tap, channel]
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden, 2 * taps * (hidden // group), bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def deltas(self, x: torch.Tensor) -> torch.Tensor:
        """Per-row deltas [blocks, B, 2, taps, groups] from the sublayer's input x [blocks, B, H]."""
        return self.kernel_projection(x).unflatten(-1, (2, self.taps, -1))

    def forward(self, x: torch.Tensor, deltas: torch.Tensor, side: int) -> torch.Tensor:
        """x [blocks, B, H] convolved along B with the `side` kernel (0: input, 1: output)."""
        kernel = self.base_kernel[side] + deltas[:, :, side].repeat_interleave(self.group, -1)  # [blocks, B, taps, H]
        out = kernel[:, :, 0] * x
        for t in range(1, self.taps):
            shifted = F.pad(x[:, :-t], (0, 0, t, 0))  # row i sees row i - t; rows before the block are zeros
            out = out + kernel[:, :, t] * shifted
        return out


class CandidateSelector(nn.Module):
    def __init__(self, hidden: int, draft_vocab: int, rank: int) -> None:
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.randn(draft_vocab + 1, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(draft_vocab, rank))  # edges start at the unary scores
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def edge_scores(self, unary: torch.Tensor, candidates: torch.Tensor, hidden: torch.Tensor,
                    prev_rows: torch.Tensor) -> torch.Tensor:
        """Scores [..., k] of edges prev -> candidates [..., k] (draft ids, with their unary logits
        [..., k]) at draft rows `hidden` [..., H]; `prev_rows` [...] index the predecessor codebook."""
        # F.embedding, not indexing: its gradient sums rows in a fixed order (an indexed tensor's backward adds
        # them in whichever order the threads run, so two trainings on the same data drifted apart)
        context = F.embedding(prev_rows, self.predecessor_codebook) * self.hidden_projection(hidden)  # [..., r]
        return unary + (F.embedding(candidates, self.successor_codebook) * context[..., None, :]).sum(-1)


class DFlash2Model(DFlashModel):
    def __init__(self, spec: DrafterSpec, target: TargetParts, draft_to_target: torch.Tensor) -> None:
        super().__init__(spec, target, draft_to_target)
        if spec.conv_kernel_size < 1 or spec.selector_rank < 1 or not 2 <= spec.selector_top_k <= spec.draft_vocab_size:
            raise ValueError("a DFlash 2 drafter needs conv_kernel_size >= 1, selector_rank >= 1 and "
                             "2 <= selector_top_k <= its draft vocabulary")
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicConv(spec.hidden_size, spec.conv_kernel_size, spec.conv_group_size)
            layer.mlp_conv = GroupedDynamicConv(spec.hidden_size, spec.conv_kernel_size, spec.conv_group_size)
        self.candidate_selector = CandidateSelector(spec.hidden_size, spec.draft_vocab_size, spec.selector_rank)
        self.register_buffer("prev_rows", draft_rows_of(draft_to_target, spec.target_vocab_size), persistent=False)

    def layer_forward(self, layer: nn.Module, hidden: torch.Tensor,
                      attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        blocks = hidden.view(-1, self.spec.block_size, hidden.shape[-1])
        normed = layer.input_layernorm(blocks)
        deltas = layer.attention_conv.deltas(normed)
        attn = attend(layer.attention_conv(normed, deltas, 0).flatten(0, 1))
        blocks = blocks + layer.attention_conv(attn.view_as(blocks), deltas, 1)
        normed = layer.post_attention_layernorm(blocks)
        deltas = layer.mlp_conv.deltas(normed)
        out = layer.mlp(layer.mlp_conv(normed, deltas, 0))
        return (blocks + layer.mlp_conv(out, deltas, 1)).flatten(0, 1)

    def candidates(self, unary: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(unary scores, draft ids) [..., k] of each row's top-k, best first."""
        return unary.topk(self.spec.selector_top_k, dim=-1)

    @torch.no_grad()
    def draft(self, hidden: torch.Tensor, anchor: int, temperature: float, generator: torch.Generator) -> Draft:
        scores_k, ids_k = self.candidates(self.target.head(hidden))
        prev = torch.tensor(anchor)
        tokens, probs, confidence = [], [], []
        for k in range(len(hidden)):
            edges = self.candidate_selector.edge_scores(scores_k[k], ids_k[k], hidden[k], self.prev_rows[prev])
            if temperature > 0:  # q lives on the candidates
                drawn, q = draw_drafts(edges[None], temperature, generator, self.d2t[ids_k[k]],
                                       self.spec.target_vocab_size)
                pick = int(drawn[0])
                probs.append(q[0])
            else:
                pick = int(edges.argmax())
            prev = self.d2t[ids_k[k, pick]]
            tokens.append(int(prev))
            top2 = edges.topk(2).values
            confidence.append(float(top2[0] - top2[1]))
        return Draft(tokens, torch.stack(probs) if probs else None, confidence)


METHOD = MethodSpec("dflash2", "DFlash with convolutions, top-16 candidates and a path ranker",
                    trained=TrainedParts(dflash_tap_layers, DFlash2Model, DFlashDrafter), block=True,
                    vllm_names=("dflash2",), needs=("hidden states",))
