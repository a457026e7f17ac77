"""The fallback target: any Hugging Face causal LM through its own module and cache.

Architectures without a forward of ours (transformer.py, hybrid.py) run here instead of being refused.
The module's kernels round differently for different pass shapes, so this is usually *not exact*: the
start-up probe decides (`Engine.exact`), the engine says so, and the stand's identical-answer rate shows
how often speculation changed an answer. Rollback crops the module's cache where it can put itself back
exactly (attention-only caches); otherwise the slot's positions are recomputed from its tokens on its
next pass, which is correct for any architecture and slow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specstand.runner.kv_cache import KVCache
from specstand.runner.transformer import ModelShape


@dataclass
class HeadWeights:
    embed_tokens: torch.Tensor
    lm_head: torch.Tensor


class ModuleCache(KVCache):
    """Per slot: the module's own cache object and the tokens whose positions it holds."""

    def __init__(self, num_slots: int, capacity: int) -> None:
        super().__init__(0, num_slots, 0, capacity, 0)
        self.module_caches: list[object | None] = [None] * num_slots
        self.tokens: list[list[int]] = [[] for _ in range(num_slots)]

    def allocate(self, slot: int | None = None) -> int:
        slot = super().allocate(slot)
        self._reset(slot)
        return slot

    def _reset(self, slot: int) -> None:
        self.module_caches[slot] = None
        self.tokens[slot] = []

    def rollback(self, slot: int, length: int) -> None:
        super().rollback(slot, length)
        cache = self.module_caches[slot]
        held = len(self.tokens[slot])
        self.tokens[slot] = self.tokens[slot][:length]
        if cache is None or held == length:
            return
        if length and getattr(cache, "is_croppable", False):
            try:
                cache.crop(length - held)  # a negative count removes that many positions
                return
            except (RuntimeError, ValueError):  # a layer that keeps no past states cannot go back
                pass
        self.module_caches[slot] = None  # recomputed from self.tokens on the slot's next pass

    @property
    def store_off_reason(self) -> str | None:
        return "the fallback forward's module cache is not K/V tensors the store can copy"

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        raise ValueError("the fallback forward does not share cached prefixes")

    def reusable_length(self, slot: int, length: int, unit: int) -> int:
        return 0

    def set_length_for_timing(self, slot: int, length: int) -> None:
        self._reset(slot)
        self.tokens[slot] = [0] * length
        super().set_length_for_timing(slot, length)


class TransformersModel:
    """The forward interface of DecoderModel over an HF module (see the module docstring)."""

    def __init__(self, hf_model: torch.nn.Module, max_positions: int) -> None:
        cfg = hf_model.config
        self.module = hf_model
        self.architecture = type(hf_model).__name__
        self.dtype = hf_model.get_input_embeddings().weight.dtype
        self.max_positions = max_positions
        self.compiled = None
        self.kernel_path = "python"  # the transformers module's own torch ops
        self.exact_by_design = False  # the module's kernels may round by pass shape: the probe decides
        heads = getattr(cfg, "num_attention_heads", 1)
        hidden = cfg.hidden_size
        self.shape = ModelShape(
            num_layers=cfg.num_hidden_layers, hidden_size=hidden, num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or hidden // heads,
            vocab_size=hf_model.get_output_embeddings().weight.shape[0],
            rms_eps=getattr(cfg, "rms_norm_eps", None) or getattr(cfg, "norm_eps", 1e-6),
            intermediate_size=getattr(cfg, "intermediate_size", 4 * hidden),
        )
        self.weights = HeadWeights(hf_model.get_input_embeddings().weight.detach(),
                                   hf_model.get_output_embeddings().weight.detach())

    def new_cache(self, num_slots: int, capacity: int) -> ModuleCache:
        return ModuleCache(num_slots, capacity)

    def forward(
        self,
        tokens: torch.Tensor,
        start_positions: list[int],
        slots: list[int],
        cache: ModuleCache,
        tap_layers: tuple[int, ...] = (),
        prefill: bool = False,
        logits_at: list[int] | None = None,
        real_rows: list[int] | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """As DecoderModel.forward, one module call per request (padding rows are not computed: their
        logits and taps repeat the last real row's)."""
        width = tokens.shape[1]
        real_rows = real_rows or [width] * len(slots)
        logits, taps = [], {k: [] for k in tap_layers}
        for b, (slot, start, real) in enumerate(zip(slots, start_positions, real_rows, strict=True)):
            rows = tokens[b, :real].tolist()
            try:
                out = self._run(cache, slot, start, rows, bool(tap_layers))
            except Exception:
                # the requests before it have advanced their caches: put them back, so that each one's pass of
                # its own (how the engine isolates a failing request) finds its cache as it was
                for done_slot, done_start in zip(slots[:b], start_positions[:b], strict=False):
                    cache.rollback(done_slot, done_start)
                raise
            pad = width - real
            last = out.logits[0, -real:]  # a recomputed slot's pass returns its earlier positions too
            request_logits = torch.cat([last, last[-1:].expand(pad, -1)]).float()
            logits.append(request_logits[logits_at[b] : logits_at[b] + 1] if logits_at is not None else request_logits)
            for k in tap_layers:
                hidden = out.hidden_states[k][0, -real:]
                taps[k].append(torch.cat([hidden, hidden[-1:].expand(pad, -1)]))
        return torch.stack(logits), {k: torch.stack(v) for k, v in taps.items()}

    def _run(self, cache: ModuleCache, slot: int, start: int, rows: list[int], hidden: bool):
        from transformers import DynamicCache

        if cache.module_caches[slot] is None:  # new, or rolled back where the module cache cannot crop
            cache.module_caches[slot] = DynamicCache(config=self.module.config)
            rows = cache.tokens[slot][:start] + rows
            start = 0
        elif len(cache.tokens[slot]) != start:
            raise RuntimeError(f"slot {slot} holds {len(cache.tokens[slot])} positions, the pass starts at {start}")
        cache.tokens[slot] = cache.tokens[slot][:start] + rows
        positions = torch.arange(start, start + len(rows))[None]
        return self.module(input_ids=torch.tensor([rows]), position_ids=positions,
                           cache=cache.module_caches[slot], use_cache=True, output_hidden_states=hidden)
