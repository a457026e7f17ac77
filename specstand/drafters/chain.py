"""The token-by-token drafter core shared by EAGLE-3 and the MTP head (see eagle3.py, mtp.py).

One decoder layer whose attention reads [norm(embedding of token x_{j+1}) ++ norm(feature_j)] (2H) with
the feature as residual; its output, normed, goes through an LM head over the draft vocabulary.
Row j: feature = the target's hidden state(s) at position j (fused by `fc` when several are tapped),
token x_{j+1}, rope position j; it predicts x_{j+2}. Drafting step s > 1 replaces the feature with the
drafter's own output of the previous step (training-time test reproduces exactly that).
"""

from __future__ import annotations

import torch
from torch import nn

from specstand.drafters.base import Draft, Drafter, HiddenRows, SequenceView, join_rows
from specstand.drafters.nn import (
    DecoderLayer,
    DrafterSpec,
    RMSNorm,
    append_keys_values,
    document_bias,
    draw_drafts,
)
from specstand.drafters.target_parts import TargetParts


class ChainModel(nn.Module):
    def __init__(self, spec: DrafterSpec, target: TargetParts, draft_to_target: torch.Tensor,
                 trainable_head: bool) -> None:
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        self.fc = nn.Linear(len(spec.tap_layers) * h, h, bias=False) if len(spec.tap_layers) > 1 else None
        self.hidden_norm = RMSNorm(h, spec.rms_eps)
        self.layers = nn.ModuleList([DecoderLayer(spec, attention_input=2 * h)])
        self.norm = RMSNorm(h, spec.rms_eps)
        self.register_buffer("d2t", draft_to_target, persistent=True)
        self.target = target.frozen_for(draft_to_target)
        self.lm_head = None
        if trainable_head:  # EAGLE-3 learns its own head, starting from the target's rows
            self.lm_head = nn.Linear(h, len(draft_to_target), bias=False)
            self.lm_head.weight.data.copy_(self.target.lm_head)

    def features(self, taps: torch.Tensor) -> torch.Tensor:
        return taps if self.fc is None else self.fc(taps)

    def _input(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        layer = self.layers[0]
        return torch.cat([layer.input_layernorm(self.target.embed(tokens)), self.hidden_norm(features)], dim=-1)

    def step(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
             bias: torch.Tensor | None, past: tuple | None) -> tuple[torch.Tensor, tuple]:
        layer = self.layers[0]
        attn, own = layer.self_attn(self._input(tokens, features), positions, bias, past)
        return layer.mlp_block(features + attn), own

    def step_segments(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                      pasts: list[tuple | None], sizes: list[int]) -> tuple[torch.Tensor, tuple]:
        """`step` for several requests at once: segment r (sizes[r] consecutive rows, causal) over its own
        `pasts[r]`; the projections and MLP run once for every row."""
        layer = self.layers[0]
        attn, own = layer.self_attn.attend_segments(self._input(tokens, features), positions, pasts, sizes, causal=True)
        return layer.mlp_block(features + attn), own

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.norm(hidden)
        return self.target.head(normed) if self.lm_head is None else self.lm_head(normed)

    def training_hidden(self, taps: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                        docs: torch.Tensor, scored: list[torch.Tensor]) -> list[torch.Tensor]:
        """Training-time test over a packed row: the output hidden states [T, H] at each drafting step s of
        the rows `scored[s - 1]` the loss reads (other rows stay 0). At step s, row j is the s-th draft after
        real row j-s+1: it sees real rows up to j-s+1 and its own chain's rows of steps 2..s (one each),
        never other chains. Every row's keys and values of step 1 are computed (they are the context); the
        queries, o_proj and MLP run only for the scored rows and the earlier steps of their chains, a few
        percent of a pack whose loss is on response tokens."""
        count, steps = len(tokens), len(scored)
        chains_inside_documents(docs, scored)
        needed = [scored[-1]] if steps else []
        for s in range(steps - 1, 0, -1):  # step s of a chain continues from step s - 1 of the row before
            needed.insert(0, torch.unique(torch.cat([scored[s - 1], needed[0] - 1])))
        attention = self.layers[0].self_attn
        next_tokens = torch.cat([tokens[1:], tokens[-1:]])  # row j reads x_{j+1} (last row: unused)
        feature = self.features(taps)
        context_input = self._input(next_tokens, feature)
        keys, values = attention.keys_values(context_input, positions)
        key_rows = [torch.arange(count)]  # the packed row of each key, and the step that wrote it
        key_steps = [torch.ones(count, dtype=torch.long)]
        outputs, previous = [], None
        for s, rows in enumerate(needed, start=1):
            if not len(rows):  # no chain reaches step s in this pack (its rows are short), nor any later step
                outputs += [torch.zeros(count, self.spec.hidden_size) for _ in range(s, steps + 1)]
                break
            if s == 1:
                x, own = context_input[rows], feature[rows]
            else:
                own = previous[torch.searchsorted(needed[s - 2], rows - 1)]
                x = self._input(next_tokens[rows], own)
                k, v = attention.keys_values(x, positions[rows])
                keys, values = torch.cat([keys, k], 1), torch.cat([values, v], 1)
                key_rows.append(rows)
                key_steps.append(torch.full((len(rows),), s))
            all_rows, all_steps = torch.cat(key_rows), torch.cat(key_steps)
            real = (all_steps == 1) & (all_rows[None, :] <= rows[:, None] - s + 1)
            chain = (all_steps > 1) & (all_rows[None, :] == rows[:, None] - (s - all_steps[None, :]))
            bias = document_bias(docs[rows], docs[all_rows], real | chain)
            attended = attention.attend(x, positions[rows], keys, values, bias)
            previous = self.layers[0].mlp_block(own + attended)
            outputs.append(torch.zeros(count, previous.shape[1]).index_put((rows,), previous))
        return outputs


def chains_inside_documents(docs: torch.Tensor, scored: list[torch.Tensor]) -> None:
    """A row scored at step s is the end of a chain from real row j-s+1, which must lie in its document:
    the training-time test reads no key across a document start (the objective scores no such row)."""
    for s, rows in enumerate(scored, start=1):
        anchors = rows - s + 1
        if len(rows) and ((anchors < 0).any() or (docs[anchors.clamp_min(0)] != docs[rows]).any()):
            raise ValueError(f"a row scored at step {s} starts its chain in another document")


class ChainDrafter(Drafter):
    """Inference: keeps the layer's keys/values of real rows per request; drafts one token per step."""

    cost_grows_with_depth = True

    def __init__(self, model: ChainModel, name: str) -> None:
        self.model = model.eval()
        self.name = name
        self.tap_layers = tuple(model.spec.tap_layers)
        self._past: dict[int, tuple | None] = {}
        self._last: dict[int, torch.Tensor] = {}  # request -> output of its last real row
        # request -> verified hidden rows not yet run through the layer: that work waits for the next
        # proposal (batched over requests), so steps without one (adaptive verification pausing drafts)
        # cost a list append
        self._pending: dict[int, list[HiddenRows]] = {}
        self._generators: dict[int, torch.Generator] = {}  # sampled drafts: a stream per request

    def begin(self, seq: SequenceView) -> None:
        self._past[seq.request_id] = None
        self._pending[seq.request_id] = []
        self._generators[seq.request_id] = torch.Generator().manual_seed(seq.request_id)

    def _choose(self, logits: torch.Tensor, seq: SequenceView) -> tuple[int, torch.Tensor | None]:
        """The next draft id from logits [1, draft vocab]: argmax, or a draw from softmax(logits / T)
        with its q over the target's vocabulary when the request samples."""
        if seq.temperature <= 0:
            return int(logits.argmax(-1)), None
        drawn, q = draw_drafts(logits, seq.temperature, self._generators[seq.request_id], self.model.d2t,
                               self.model.spec.target_vocab_size)
        return int(drawn[0]), q[0]

    def extend(self, seq: SequenceView, new_tokens: list[int], hidden: HiddenRows | None = None) -> None:
        if hidden is not None and hidden.rows:
            self._pending[seq.request_id].append(hidden)

    @torch.inference_mode()
    def _catch_up(self, seqs: list[SequenceView]) -> None:
        """Run the layer once over every pending row of these requests: row j reads the target's hidden
        state at position j and token x_{j+1} (verified by now)."""
        behind = [seq for seq in seqs if self._pending.get(seq.request_id)]
        if not behind:
            return
        tokens, taps, positions, sizes = [], [], [], []
        for seq in behind:
            rows, rows_taps = join_rows(self._pending[seq.request_id], self.tap_layers)
            positions.append(rows)
            taps.append(rows_taps)
            tokens.append(torch.tensor(seq.token_ids[int(rows[0]) + 1 : int(rows[-1]) + 2]))
            sizes.append(len(rows))
        pasts = [self._past[seq.request_id] for seq in behind]
        out, (k, v) = self.model.step_segments(torch.cat(tokens), self.model.features(torch.cat(taps)),
                                               torch.cat(positions), pasts, sizes)
        end = 0
        for seq, past, size in zip(behind, pasts, sizes, strict=True):  # rows leave pending once computed
            self._pending[seq.request_id].clear()
            self._past[seq.request_id] = append_keys_values(past, (k[:, end : end + size], v[:, end : end + size]))
            end += size
            self._last[seq.request_id] = out[end - 1 : end]

    @torch.inference_mode()
    def propose(self, seq: SequenceView, max_tokens: int) -> Draft:
        if max_tokens <= 0:
            return Draft([])
        self._catch_up([seq])
        last = self._last.get(seq.request_id)
        if last is None:
            return Draft([])
        past = self._past[seq.request_id]
        draft, margins, probs = [], [], []
        position = len(seq.token_ids) - 1
        while True:
            logits = self.model.logits(last)
            top2 = logits.topk(2, dim=-1).values[0]  # its margin: confidence for adaptive verification
            choice, q = self._choose(logits, seq)
            draft.append(choice)
            probs.append(q)
            margins.append(float(top2[0] - top2[1]))
            if len(draft) == max_tokens:
                break
            token = self.model.d2t[draft[-1:]]
            last, own = self.model.step(token, last, torch.tensor([position]), None, past)
            past = append_keys_values(past, own)
            position += 1
        return Draft(self.model.d2t[draft].tolist(), None if probs[0] is None else torch.stack(probs), margins)

    @torch.inference_mode()
    def propose_many(self, seqs: list[SequenceView], max_tokens: list[int]) -> list[Draft]:
        """Every ready request's chain advanced together: one head and one layer call per step for all."""
        self._catch_up([seq for seq, k in zip(seqs, max_tokens, strict=True) if k > 0])
        ready = [i for i, (seq, k) in enumerate(zip(seqs, max_tokens, strict=True))
                 if k > 0 and self._last.get(seq.request_id) is not None]
        if len(ready) <= 1:
            return super().propose_many(seqs, max_tokens)
        last = torch.cat([self._last[seqs[i].request_id] for i in ready])
        pasts = [self._past[seqs[i].request_id] for i in ready]
        positions = torch.tensor([len(seqs[i].token_ids) - 1 for i in ready])
        steps = max(max_tokens[i] for i in ready)
        chosen, margins, probs = [], [], [[] for _ in ready]
        for step in range(steps):
            logits = self.model.logits(last)
            top2 = logits.topk(2, dim=-1).values
            choice = logits.argmax(-1)
            for r, i in enumerate(ready):
                if seqs[i].temperature > 0:
                    choice[r], q = self._choose(logits[r : r + 1], seqs[i])
                    probs[r].append(q)
            chosen.append(choice)
            margins.append(top2[:, 0] - top2[:, 1])
            if step + 1 == steps:
                break
            last, (k, v) = self.model.step_segments(self.model.d2t[chosen[-1]], last, positions, pasts,
                                                    [1] * len(ready))
            pasts = [append_keys_values(past, (k[:, r : r + 1], v[:, r : r + 1])) for r, past in enumerate(pasts)]
            positions = positions + 1
        tokens, margins = self.model.d2t[torch.stack(chosen, 1)].tolist(), torch.stack(margins, 1).tolist()
        drafts = [Draft([]) for _ in seqs]
        for r, i in enumerate(ready):
            k = max_tokens[i]
            drafts[i] = Draft(tokens[r][:k], torch.stack(probs[r][:k]) if probs[r] else None, margins[r][:k])
        return drafts

    def end(self, seq: SequenceView) -> None:
        self._past.pop(seq.request_id, None)
        self._last.pop(seq.request_id, None)
        self._pending.pop(seq.request_id, None)
        self._generators.pop(seq.request_id, None)
