"""TargetRunner: one target pass over a batch of requests, each with its own cache slot and row count."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from specstand.runner.compiled import CompiledDecoder
from specstand.runner.kv_cache import PREFILL_BLOCK
from specstand.runner.target import TargetModel
from specstand.runner.transformer import ATTENTION_BUCKET

# Rows per compiled prompt pass: the linears then stream their weights once for many rows, and only the
# last pass of a prompt computes logits (one row).
PROMPT_CHUNK = 512

__all__ = ["PREFILL_BLOCK", "PROMPT_CHUNK", "PassInput", "PassOutput", "TargetRunner"]


@dataclass
class PassInput:
    slot: int
    tokens: list[int]  # computed at positions cache.lengths[slot], +1, ...
    # which rows' logits come back: "all" (decode/verify), "last" (a prompt's final chunk) or "none" (a
    # prompt chunk before it); only the compiled forward takes the last two in a shared pass
    logits: str = "all"


@dataclass
class PassOutput:
    logits: torch.Tensor  # [len(tokens), vocab] fp32
    taps: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [len(tokens), hidden]


class TargetRunner:
    def __init__(self, model: TargetModel, num_slots: int, capacity: int) -> None:
        """`model`: DecoderModel, HybridModel or TransformersModel (runner/target.py)."""
        if capacity > model.max_positions:
            raise ValueError(f"cache capacity {capacity} exceeds the model's {model.max_positions} positions")
        self.model = model
        # passes run the model's compiled forward where it has one; prompts too where its path is fast for
        # many rows (bf16 dot-product instructions), else torch's GEMMs
        self.compiled: CompiledDecoder | None = model.compiled
        self.compiled_prompts = self.compiled is not None and self.compiled.fast_for_prompts
        self.capacity = capacity
        # attention reads whole buckets, so the buffers end on a bucket boundary
        buffer_len = -(-capacity // ATTENTION_BUCKET) * ATTENTION_BUCKET
        self.cache = model.new_cache(num_slots, buffer_len)

    @torch.inference_mode()
    def run(
        self, inputs: list[PassInput], width: int, tap_layers: tuple[int, ...] = (), prefill: bool = False
    ) -> list[PassOutput]:
        """One target pass. Every request gets exactly `width` rows (padding repeats its last token), so
        the pass shape does not depend on draft lengths. Cache lengths advance by the real rows. A
        `prefill` pass returns the logits of each request's last real row only. With the compiled forward a
        decode/verify pass computes the real rows only: its rows do not depend on each other's count."""
        starts = [self.cache.lengths[item.slot] for item in inputs]
        compiled = self.compiled is not None and not prefill
        for item, start in zip(inputs, starts, strict=True):
            if not 0 < len(item.tokens) <= width:
                raise ValueError(f"a pass needs 1..{width} tokens per request, got {len(item.tokens)}")
            # the Python forward writes padding rows too (into the bucket's tail); compiled rows are real
            if start + (len(item.tokens) if compiled else width) > self.cache.capacity:
                raise ValueError(f"slot {item.slot} would exceed the cache capacity {self.capacity}")
        if compiled:
            return self._run_compiled(inputs, starts, tap_layers)
        if any(item.logits != "all" for item in inputs):
            raise ValueError("prompt chunks share a pass only where prompts run compiled")
        rows = [item.tokens + [item.tokens[-1]] * (width - len(item.tokens)) for item in inputs]
        logits, taps = self.model.forward(
            torch.tensor(rows), starts, [item.slot for item in inputs], self.cache, tap_layers, prefill,
            logits_at=[len(item.tokens) - 1 for item in inputs] if prefill else None,
            real_rows=[len(item.tokens) for item in inputs],
        )
        outputs = []
        for b, item in enumerate(inputs):
            n = len(item.tokens)
            self.cache.advance(item.slot, starts[b], n)
            rows = logits[b] if prefill else logits[b, :n]
            outputs.append(PassOutput(rows, {layer: t[b, :n] for layer, t in taps.items()}))
        return outputs

    def _run_compiled(
        self, inputs: list[PassInput], starts: list[int], tap_layers: tuple[int, ...]
    ) -> list[PassOutput]:
        tokens = [t for item in inputs for t in item.tokens]
        slots = [item.slot for item in inputs for _ in item.tokens]
        positions = [start + i for item, start in zip(inputs, starts, strict=True) for i in range(len(item.tokens))]
        ends = list(itertools.accumulate(len(item.tokens) for item in inputs))
        wanted = [_logit_rows(item, end) for item, end in zip(inputs, ends, strict=True)]
        logits, taps = self.compiled.forward(
            tokens, slots, positions, self.cache.keys, self.cache.values, tap_layers, [r for w in wanted for r in w]
        )
        outputs, first = [], 0
        for item, start, end, rows in zip(inputs, starts, ends, wanted, strict=True):
            n = len(item.tokens)
            self.cache.advance(item.slot, start, n)
            rows_taps = {k: t[end - n : end] for k, t in taps.items()}
            outputs.append(PassOutput(logits[first : first + len(rows)], rows_taps))
            first += len(rows)
        return outputs

    def prefill(self, slot: int, tokens: list[int], tap_layers: tuple[int, ...] = ()) -> PassOutput:
        """Compute the prompt `tokens` from the slot's current length (a reused head: any length where
        prompts run compiled, else a multiple of PREFILL_BLOCK) on; returns the logits of its last position
        and the taps of the computed positions."""
        start = self.cache.lengths[slot]
        if start >= len(tokens) or (start % PREFILL_BLOCK and not self.compiled_prompts):
            raise ValueError(f"a prompt prefill must start on a block boundary before its end, not at {start}")
        if self.compiled_prompts:
            if len(tokens) > self.capacity:
                raise ValueError(f"a prompt of {len(tokens)} tokens exceeds the cache capacity {self.capacity}")
            parts = []
            for begin in range(start, len(tokens), PROMPT_CHUNK):
                chunk = tokens[begin : begin + PROMPT_CHUNK]
                last = begin + PROMPT_CHUNK >= len(tokens)
                parts.append(self._run_compiled([PassInput(slot, chunk, "last" if last else "none")], [begin],
                                                tap_layers)[0])
            return PassOutput(parts[-1].logits, {k: torch.cat([p.taps[k] for p in parts]) for k in tap_layers})
        parts = []
        for begin in range(start, len(tokens), PREFILL_BLOCK):
            block = tokens[begin : begin + PREFILL_BLOCK]
            parts.append(self.run([PassInput(slot, block)], PREFILL_BLOCK, tap_layers, prefill=True)[0])
        return PassOutput(parts[-1].logits, {layer: torch.cat([p.taps[layer] for p in parts]) for layer in tap_layers})


def _logit_rows(item: PassInput, end: int) -> list[int]:
    """The pass rows whose logits `item` wants; its rows end (exclusive) at pass row `end`."""
    if item.logits == "all":
        return list(range(end - len(item.tokens), end))
    if item.logits == "last":
        return [end - 1]
    if item.logits == "none":
        return []
    raise ValueError(f"unknown logits selection {item.logits!r}")
