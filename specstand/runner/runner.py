"""TargetRunner: one target pass over a batch of requests, each with its own cache slot and row count."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specstand.runner.kv_cache import KVCache
from specstand.runner.transformer import ATTENTION_BUCKET, DecoderModel

PREFILL_CHUNK = 512  # caps the fp32 score buffer of long prompts


@dataclass
class PassInput:
    slot: int
    tokens: list[int]  # computed at positions cache.lengths[slot], +1, ...


@dataclass
class PassOutput:
    logits: torch.Tensor  # [len(tokens), vocab] fp32
    taps: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [len(tokens), hidden]


class TargetRunner:
    def __init__(self, model: DecoderModel, num_slots: int, capacity: int) -> None:
        if capacity > model.max_positions:
            raise ValueError(f"cache capacity {capacity} exceeds the model's {model.max_positions} positions")
        s = model.shape
        self.model = model
        self.capacity = capacity
        # attention reads whole buckets, so the buffers end on a bucket boundary
        buffer_len = -(-capacity // ATTENTION_BUCKET) * ATTENTION_BUCKET
        self.cache = KVCache(s.num_layers, num_slots, s.num_kv_heads, buffer_len, s.head_dim)

    @torch.inference_mode()
    def run(
        self, inputs: list[PassInput], width: int, tap_layers: tuple[int, ...] = (), prefill: bool = False
    ) -> list[PassOutput]:
        """One target pass. Every request gets exactly `width` rows (padding repeats its last token), so
        the pass shape does not depend on draft lengths. Cache lengths advance by the real rows."""
        starts = [self.cache.lengths[item.slot] for item in inputs]
        for item, start in zip(inputs, starts, strict=True):
            if not 0 < len(item.tokens) <= width:
                raise ValueError(f"a pass needs 1..{width} tokens per request, got {len(item.tokens)}")
            if start + width > self.capacity:
                raise ValueError(f"slot {item.slot} would exceed the cache capacity {self.capacity}")
        rows = [item.tokens + [item.tokens[-1]] * (width - len(item.tokens)) for item in inputs]
        logits, taps = self.model.forward(
            torch.tensor(rows), starts, [item.slot for item in inputs],
            self.cache.keys, self.cache.values, tap_layers, prefill,
        )
        outputs = []
        for b, item in enumerate(inputs):
            n = len(item.tokens)
            self.cache.lengths[item.slot] = starts[b] + n
            rows = logits[b] if prefill else logits[b, :n]
            outputs.append(PassOutput(rows, {layer: t[b, :n] for layer, t in taps.items()}))
        return outputs

    def prefill(self, slot: int, tokens: list[int], tap_layers: tuple[int, ...] = ()) -> PassOutput:
        """Compute a prompt in chunks; returns the logits of its last position and the taps of all."""
        parts = []
        for begin in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[begin : begin + PREFILL_CHUNK]
            parts.append(self.run([PassInput(slot, chunk)], len(chunk), tap_layers, prefill=True)[0])
        return PassOutput(parts[-1].logits, {layer: torch.cat([p.taps[layer] for p in parts]) for layer in tap_layers})
