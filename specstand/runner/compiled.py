"""The decode/verify forward as one compiled call (specstand/kernels), beside the Python reference.

`DecoderModel` (transformer.py) stays the readable reference. Decode and verify rows run here: every op
is row-local with a fixed reduction order, so a row's logits are bit-identical whether it is alone in its
pass or one of U users x (K + 1) rows, and no padding is needed (`row_unit` 1). Prompts run here too
on every vector path (amx, avx512bf16, avx2: their tiles reuse each weight over 6-32 rows, so a 512-row
pass costs a few decode steps); the scalar path leaves them to torch's GEMMs.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from specstand import kernels
from specstand.kernels import q8_0
from specstand.runner.transformer import DecoderModel, Weights

WEIGHT_FORMATS = ("bf16", "q8_0")
Q8Blocks = tuple[torch.Tensor, torch.Tensor]  # (q int8 [n, k], d fp16 [n, k / 32]): kernels/q8_0.py

PROMPT_PATHS = ("amx", "avx512bf16", "avx2")  # kernel paths that also compute prompt blocks


class CompiledDecoder:
    """Packed weights of a DecoderModel (bf16, or Q8_0 blocks: `weight_format`) and its compiled forward."""

    def __init__(self, model: DecoderModel, path: str, blocks: list[Q8Blocks] | None = None) -> None:
        """`blocks`: Q8_0 blocks of model.linear_weights(), in that order, to run instead of the bf16 weights."""
        if model.dtype != torch.bfloat16:
            raise kernels.KernelsUnavailable("the compiled forward runs bf16 weights; this model is not bf16")
        s = model.shape
        w = model.weights
        intermediate = w.layers[0].down.shape[1]
        if s.hidden_size % 8 or s.head_dim % 8 or intermediate % 8:
            raise kernels.KernelsUnavailable("the compiled forward needs widths in multiples of 8")
        self.path = path
        self.weight_format = "bf16" if blocks is None else "q8_0"
        self.fast_for_prompts = path in PROMPT_PATHS
        self.model = model
        module = kernels.load()
        isa = kernels.PATHS[path]
        self._decoder = module.Decoder(s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, intermediate,
                                       s.rms_eps, isa)
        # packed in linear_weights() order: per layer qkv, o_proj, gate_up, down; then the head
        packed = iter([module.Linear(weight, isa) for weight in model.linear_weights()] if blocks is None
                      else [module.Linear(q, d, isa) for q, d in blocks])
        empty = torch.empty(0)
        for layer in w.layers:
            qkv, o_proj, gate_up, down = next(packed), next(packed), next(packed), next(packed)
            self._decoder.add_layer(
                qkv, empty if layer.qkv_bias is None else layer.qkv_bias, o_proj,
                empty if layer.q_norm is None else layer.q_norm, empty if layer.k_norm is None else layer.k_norm,
                layer.input_norm, layer.post_attention_norm, gate_up, down,
            )
        self._decoder.set_head(w.embed_tokens.contiguous(), w.final_norm, next(packed), torch.view_as_real(model.rope))

    def forward(
        self,
        tokens: list[int],
        slots: list[int],
        positions: list[int],
        keys: torch.Tensor,
        values: torch.Tensor,
        tap_layers: tuple[int, ...] = (),
        logit_rows: list[int] | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Rows of any requests at once: row r is token tokens[r] at position positions[r] of cache slot
        slots[r], attending over that slot's positions 0..positions[r] (rows of one request see each
        other). Returns fp32 logits [len(logit_rows), vocab] (default: every row) and taps
        {layer: [rows, hidden]} in the model dtype."""
        wanted = sorted(set(tap_layers))
        logits, taps = self._decoder.forward(
            torch.tensor(tokens), torch.tensor(slots), torch.tensor(positions), keys, values, wanted,
            list(range(len(tokens))) if logit_rows is None else logit_rows,
        )
        return logits, {layer: t.to(self.model.dtype) for layer, t in zip(wanted, taps, strict=True)}

    @property
    def fused_mlp_layers(self) -> int:
        """Layers whose MLP runs gate/up and its activation as one kernel (amx with bf16 weights)."""
        return self._decoder.fused_mlp_layers

    def take_profile(self) -> dict[str, float]:
        """Seconds spent in linears, attention, the head and everything else since the last call."""
        return self._decoder.take_profile()


def attach_compiled(model: DecoderModel, path: str, log=None, weight_format: str = "bf16",
                    published: dict[str, Q8Blocks] | None = None) -> CompiledDecoder | None:
    """Give `model` its compiled forward on kernel `path` (chosen once, at load: kernels.chosen_path) and
    return it, or leave it on the Python forward and return None (the reason logged) where that cannot run:
    path "python", not bf16, or a shape the kernels do not take. `weight_format` q8_0 quantizes the linears
    to Q8_0 blocks (or takes `published` ones, {transformers name: blocks}: a GGUF's own,
    models/gguf_blocks.py), and the Python forward's weights to the same values, so prompts computed by
    torch (scalar path) see the model the compiled rows see; q8_0 needs the kernels."""
    try:
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight format {weight_format!r} (choose from {', '.join(WEIGHT_FORMATS)})")
        if path == "python":
            raise kernels.KernelsUnavailable(kernels.chosen_path()[1] or "kernel path python: the Python forward")
        blocks = None
        if weight_format == "q8_0":
            blocks = (_fused(model, published) if published is not None
                      else [q8_0.quantize(t) for t in model.linear_weights()])
        compiled = CompiledDecoder(model, path, blocks)
    except kernels.KernelsUnavailable as reason:
        if weight_format == "q8_0":
            raise
        if log is not None and model.dtype == torch.bfloat16 and os.environ.get(kernels.PATH_ENV) != "python":
            log(str(reason))
        return None
    if blocks is None:
        model.use_compiled(compiled)
    else:
        weights = _dequantized(model.weights, blocks)
        shared = model.prefill_weights is model.weights
        model.use_compiled(compiled, weights, weights if shared else _dequantized(model.prefill_weights, blocks))
    return compiled


def _fused(model: DecoderModel, published: dict[str, Q8Blocks]) -> list[Q8Blocks]:
    """Per-matrix blocks under transformers names, stacked and reordered as the model stacks its weights
    (q/k/v rows interleaved and stacked, gate and up stacked): model.linear_weights() order. A row
    permutation applies to q and d alike."""
    s = model.shape

    def take(name: str) -> Q8Blocks:
        if name not in published:
            raise ValueError(f"the published Q8_0 blocks lack {name}")
        return published[name]

    def stacked(parts: list[Q8Blocks]) -> Q8Blocks:
        return torch.cat([q for q, _ in parts]), torch.cat([d for _, d in parts])

    blocks = []
    for i in range(s.num_layers):
        layer = f"model.layers.{i}."
        q, k, v = (take(f"{layer}self_attn.{x}_proj.weight") for x in "qkv")
        blocks += [
            stacked([tuple(model.interleave_rows(t, s.num_heads) for t in q),
                     tuple(model.interleave_rows(t, s.num_kv_heads) for t in k), v]),
            take(f"{layer}self_attn.o_proj.weight"),
            stacked([take(f"{layer}mlp.gate_proj.weight"), take(f"{layer}mlp.up_proj.weight")]),
            take(f"{layer}mlp.down_proj.weight"),
        ]
    blocks.append(take("lm_head.weight"))
    for (q, _), weight in zip(blocks, model.linear_weights(), strict=True):
        if q.shape != weight.shape:
            raise ValueError(f"published Q8_0 blocks of shape {tuple(q.shape)} for a weight of {tuple(weight.shape)}")
    return blocks


def _dequantized(weights: Weights, blocks: list[Q8Blocks]) -> Weights:
    """`weights` with every linear (in linear_weights() order) replaced by the values of its Q8_0 blocks, in
    the weight's own dtype (fp32 holds them exactly, bf16 rounds them)."""
    values = iter(blocks)

    def dequantized(t: torch.Tensor) -> torch.Tensor:
        return q8_0.dequantize(*next(values)).to(t.dtype)

    layers = [replace(layer, qkv=dequantized(layer.qkv), o_proj=dequantized(layer.o_proj),
                      gate_up=dequantized(layer.gate_up), down=dequantized(layer.down)) for layer in weights.layers]
    return replace(weights, layers=layers, lm_head=dequantized(weights.lm_head))
