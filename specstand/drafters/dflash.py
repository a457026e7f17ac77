"""DFlash: block diffusion drafting, one drafter pass per block.

Context: the target's hidden states at several depths, concatenated, projected by `fc` and normed
(`hidden_norm`). In every drafter layer the queries come from the block only, while keys/values are
k_proj/v_proj of the context followed by those of the block. The block is [last emitted token, MASK x
(B-1)] at its real positions; attention inside the block is non-causal, so all B-1 drafts come out of ONE
pass. Embedding and LM head rows are the target's (frozen, not saved); the head covers a draft vocabulary.

Position convention (shared with training): context row j is the target's hidden state at position j;
block row 0 is the token at position n-1 (not yet seen by the target), row i predicts position n-1+i (or
n+i with `sample_from_anchor`, DSpark's layout, where the anchor row makes the first draft).

DSpark (dspark.py) and DFlash 2 (dflash2.py) are this model with other heads: they override `draft`
(how tokens are picked from the draft rows' hidden states) and, DFlash 2, `layer_forward`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from specstand.drafters.base import Draft, Drafter, HiddenRows, MethodSpec, SequenceView, TrainedParts, join_rows
from specstand.drafters.nn import DecoderLayer, DrafterSpec, RMSNorm, append_keys_values, document_bias, draw_drafts
from specstand.drafters.target_parts import TargetParts


class DFlashModel(nn.Module):
    def __init__(self, spec: DrafterSpec, target: TargetParts, draft_to_target: torch.Tensor) -> None:
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        self.fc = nn.Linear(len(spec.tap_layers) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, spec.rms_eps)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(h, spec.rms_eps)
        self.register_buffer("d2t", draft_to_target, persistent=True)
        self.target = target.frozen_for(draft_to_target)

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """Fused context rows [T, H] from concatenated taps [T, len(tap_layers) * H]."""
        return self.hidden_norm(self.fc(taps))

    def context_keys_values(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple]:
        return [layer.self_attn.keys_values(context, positions) for layer in self.layers]

    @property
    def first_draft_row(self) -> int:
        """The block row whose output is the first draft: 0 when the anchor row predicts (DSpark's
        sample_from_anchor), else 1 (DFlash: row 0 only carries the anchor token)."""
        return 0 if self.spec.sample_from_anchor else 1

    @property
    def num_drafts(self) -> int:
        return self.spec.block_drafts

    def layer_forward(self, layer: nn.Module, hidden: torch.Tensor,
                      attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """One drafter layer over block rows; `attend` is its attention over the context and the block."""
        return layer.mlp_block(hidden + attend(layer.input_layernorm(hidden)))

    def _layers(self, block_tokens: torch.Tensor, attend: Callable[[int, nn.Module, torch.Tensor], torch.Tensor]):
        hidden = self.target.embed(block_tokens)
        for i, layer in enumerate(self.layers):
            hidden = self.layer_forward(layer, hidden, lambda x, i=i, layer=layer: attend(i, layer, x))
        return self.norm(hidden)

    def block_hidden(
        self, block_tokens: torch.Tensor, positions: torch.Tensor, past: list[tuple], bias: torch.Tensor | None
    ) -> torch.Tensor:
        """Final normed hidden states [rows, H] of block rows (tokens [rows], whole blocks of block_size
        rows one after another) over per-layer context keys/values `past`. `bias` [rows, context + rows]:
        None = everything visible."""
        return self._layers(block_tokens, lambda i, layer, x: layer.self_attn(x, positions, bias, past[i])[0])

    def blocks_hidden(self, block_tokens: torch.Tensor, positions: torch.Tensor, pasts: list[list[tuple]]
                      ) -> torch.Tensor:
        """`block_hidden` of several requests' blocks in one pass, block r over its own per-layer context
        `pasts[r]`: the projections and MLPs run once for every row."""
        sizes = [self.spec.block_size] * len(pasts)
        return self._layers(block_tokens, lambda i, layer, x: layer.self_attn.attend_segments(
            x, positions, [p[i] for p in pasts], sizes, causal=False)[0])

    def training_hidden(self, taps: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                        docs: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Hidden states [anchors, drafts, H] of the draft rows of blocks starting at `anchors` (indices
        into the packed row), all in one pass: each block sees the context strictly before its anchor (same
        document) and its own rows, never another block."""
        b = self.spec.block_size
        offsets = torch.arange(b)
        block_tokens = torch.full((len(anchors), b), self.spec.mask_token_id)
        block_tokens[:, 0] = tokens[anchors]
        block_positions = positions[anchors][:, None] + offsets[None]
        block_docs = docs[anchors][:, None].expand(-1, b)
        context = self.context(taps)
        past = self.context_keys_values(context, positions)
        rows = len(anchors) * b
        sees_context = torch.arange(len(tokens))[None, :] < anchors.repeat_interleave(b)[:, None]
        owner = torch.arange(len(anchors)).repeat_interleave(b)
        sees_block = owner[:, None] == owner[None, :]
        bias = torch.cat([
            document_bias(block_docs.reshape(-1), docs, sees_context),
            torch.zeros(rows, rows).masked_fill(~sees_block, float("-inf")),
        ], dim=1)
        hidden = self.block_hidden(block_tokens.reshape(-1), block_positions.reshape(-1), past, bias)
        return hidden.view(len(anchors), b, -1)[:, self.first_draft_row :]

    @torch.no_grad()
    def draft(self, hidden: torch.Tensor, anchor: int, temperature: float, generator: torch.Generator) -> Draft:
        """Draft tokens from the draft rows' hidden states [n, H]: each position's argmax, or when sampling
        an independent draw from softmax(logits / T) with that q; the top-1 minus top-2 logit margin as
        confidence."""
        logits = self.target.head(hidden)
        top2 = logits.topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        if temperature > 0:
            drawn, q = draw_drafts(logits, temperature, generator, self.d2t, self.spec.target_vocab_size)
            return Draft(self.d2t[drawn].tolist(), q, margins)
        return Draft(self.d2t[logits.argmax(-1)].tolist(), confidence=margins)


class DFlashDrafter(Drafter):
    name = "dflash"

    def __init__(self, model: DFlashModel) -> None:
        self.name = model.spec.method  # dflash, dspark or dflash2
        self.model = model.eval()
        self.tap_layers = tuple(model.spec.tap_layers)
        self._context: dict[int, list[tuple]] = {}  # request -> per-layer context keys/values
        # request -> hidden rows not yet turned into context keys/values: that work waits for the next
        # proposal, so steps without one (adaptive verification pausing drafts) cost a list append
        self._pending: dict[int, list[HiddenRows]] = {}
        self._generators: dict[int, torch.Generator] = {}

    @property
    def default_k(self) -> int:
        return self.model.num_drafts  # a block's drafts: its size - 1, or all of it where drafts start at the anchor

    def begin(self, seq: SequenceView) -> None:
        self._context[seq.request_id] = []
        self._pending[seq.request_id] = []
        # drafts sampled by DSpark and DFlash 2: a stream of their own per request (any draw is lossless)
        self._generators[seq.request_id] = torch.Generator().manual_seed(seq.request_id)

    def extend(self, seq: SequenceView, new_tokens: list[int], hidden: HiddenRows | None = None) -> None:
        if hidden is not None and hidden.rows:
            self._pending[seq.request_id].append(hidden)

    @torch.inference_mode()
    def _catch_up(self, request_ids: list[int]) -> None:
        """Turn every pending hidden row of these requests into context keys/values, in one call for all
        (the context rows and their keys/values are computed row by row)."""
        behind = [r for r in request_ids if self._pending.get(r)]
        if not behind:
            return
        counts = [sum(h.rows for h in self._pending[r]) for r in behind]
        positions, taps = join_rows([h for r in behind for h in self._pending[r]], self.tap_layers)
        new = self.model.context_keys_values(self.model.context(taps), positions)
        end = 0
        for r, n in zip(behind, counts, strict=True):
            self._pending[r].clear()
            old = self._context[r] or [None] * len(new)
            self._context[r] = [append_keys_values(past, (k[:, end : end + n], v[:, end : end + n]))
                                for past, (k, v) in zip(old, new, strict=True)]
            end += n

    def _block(self, seq: SequenceView) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and positions of the request's next block: [last token, MASK x (B-1)] at n-1, n, ..."""
        b = self.model.spec.block_size
        tokens = torch.full((b,), self.model.spec.mask_token_id)
        tokens[0] = seq.token_ids[-1]
        return tokens, len(seq.token_ids) - 1 + torch.arange(b)

    def _draft(self, seq: SequenceView, block_hidden: torch.Tensor, max_tokens: int) -> Draft:
        first = self.model.first_draft_row
        rows = block_hidden[first : first + max_tokens]
        return self.model.draft(rows, seq.token_ids[-1], seq.temperature, self._generators[seq.request_id])

    def _ready(self, seq: SequenceView, max_tokens: int) -> bool:
        """Whether the request can draft now (once its context has caught up)."""
        return max_tokens > 0 and bool(self._context.get(seq.request_id))

    @torch.inference_mode()
    def propose(self, seq: SequenceView, max_tokens: int) -> Draft:
        self._catch_up([seq.request_id])
        if not self._ready(seq, max_tokens):
            return Draft([])
        tokens, positions = self._block(seq)
        hidden = self.model.block_hidden(tokens, positions, self._context[seq.request_id], None)
        return self._draft(seq, hidden, max_tokens)

    @torch.inference_mode()
    def propose_many(self, seqs: list[SequenceView], max_tokens: list[int]) -> list[Draft]:
        """One drafter pass over every ready request's block (per-request attention over its own context)."""
        self._catch_up([seq.request_id for seq, k in zip(seqs, max_tokens, strict=True) if k > 0])
        ready = [i for i, (seq, k) in enumerate(zip(seqs, max_tokens, strict=True)) if self._ready(seq, k)]
        drafts = [Draft([]) for _ in seqs]
        if len(ready) == 1:
            drafts[ready[0]] = self.propose(seqs[ready[0]], max_tokens[ready[0]])
        elif ready:
            blocks = [self._block(seqs[i]) for i in ready]
            hidden = self.model.blocks_hidden(torch.cat([t for t, _ in blocks]), torch.cat([p for _, p in blocks]),
                                              [self._context[seqs[i].request_id] for i in ready])
            b = self.model.spec.block_size
            for j, i in enumerate(ready):
                drafts[i] = self._draft(seqs[i], hidden[j * b : (j + 1) * b], max_tokens[i])
        return drafts

    def end(self, seq: SequenceView) -> None:
        self._context.pop(seq.request_id, None)
        self._pending.pop(seq.request_id, None)
        self._generators.pop(seq.request_id, None)


def dflash_tap_layers(num_layers: int, count: int = 5) -> list[int]:
    """`count` layer outputs spread from layer 1 to layer L-3 (z-lab's spacing), in HF numbering."""
    last = max(num_layers - 3, 1)
    ids = {round(1 + i * (last - 1) / max(count - 1, 1)) for i in range(count)}
    return sorted(i + 1 for i in ids)


METHOD = MethodSpec("dflash", "DFlash: a block of drafts in one pass",
                    trained=TrainedParts(dflash_tap_layers, DFlashModel, DFlashDrafter), block=True,
                    vllm_names=("dflash",), needs=("hidden states",))
