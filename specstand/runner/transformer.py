"""A Llama/Qwen-family decoder forward written directly on the Hugging Face weights (gpt-fast style).

Why not call the transformers module: its attention (SDPA) rounds differently depending on how many
query rows a pass holds, so a draft-verify pass and a one-token pass disagree in the last bits and greedy
answers drift. Here every op is row-local (linears, RMSNorm, RoPE) and attention runs in fp32 with a
reduction length and a row count that depend on the position alone, not on the pass (see `attend`).
Whether the machine's kernels really keep rows independent is checked at start-up (`exactness.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specstand import kernels
from specstand.runner.kv_cache import KVCache

if TYPE_CHECKING:  # compiled.py builds on this module
    from specstand.runner.compiled import CompiledDecoder

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ATTENTION_BUCKET = 128  # a row at position p attends over roundup(p + 1, ATTENTION_BUCKET) cache positions
ATTENTION_ROW_BLOCK = 8  # query rows are zero-padded to a multiple of this inside attention


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # q, k, v projections stacked (q and k rows in interleaved-rope order)
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    q_norm: torch.Tensor | None  # Qwen3 normalises q and k per head
    k_norm: torch.Tensor | None
    post_attention_norm: torch.Tensor
    gate_up: torch.Tensor  # gate and up projections stacked
    down: torch.Tensor


@dataclass
class Weights:
    embed_tokens: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor

    def with_layers_in(self, dtype: torch.dtype) -> Weights:
        """A copy whose layers compute in `dtype`. The embedding table and the head stay shared: a looked-up
        row is cast exactly, and the head runs once per prompt, on one row."""
        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(dtype)

        layers = [LayerWeights(**{k: cast(v) for k, v in vars(layer).items()}) for layer in self.layers]
        return Weights(self.embed_tokens, layers, cast(self.final_norm), self.lm_head)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           rows_alone: bool = False) -> torch.Tensor:
    """torch's F.linear; `rows_alone` computes every bf16 row in a 1-row call of its own, for rows whose
    result must not depend on the pass (fp32 rows are left to the start-up probe, whose logits show any
    difference): torch's bf16 GEMMs accumulate in fp32 in an order that can depend on the row count, and
    the rounding to bf16 hides it from the start-up probe almost always
    (measured on a Zen 4: 2 in 10^4 outputs of Qwen's down projection differ between a 1-row and a 2-row
    call, and a tiny Qwen3.5's probe passed while it answered 3 requests at a time differently)."""
    rows = x.reshape(-1, x.shape[-1])
    if not rows_alone or x.dtype != torch.bfloat16 or rows.shape[0] == 1:
        return F.linear(x, weight, bias)
    return torch.cat([F.linear(row, weight, bias) for row in rows.split(1)]).reshape(*x.shape[:-1], -1)


def has_fast_bf16_matmul() -> bool:
    """True where the CPU has bf16 matrix instructions (AVX512-BF16 or AMX). Without them a bf16 GEMM
    costs about one GEMV per row (measured on an AVX2 EPYC: 8 rows cost 7.5x one row, in fp32 2.1x)."""
    flags = kernels.all_cpu_flags()
    if flags is None:
        return True  # not Linux: assume nothing and keep one copy of the weights
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float
    intermediate_size: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass
class _AttentionRun:
    """Consecutive rows of one request that attend over the same cache length."""

    row: int
    rows: int
    length: int
    bias: torch.Tensor  # [padded rows, length]: 0 where a key is visible, -inf where it is in the future


def unsupported_parts(hf_model: torch.nn.Module, max_positions: int) -> str:
    """What a Llama-family checkpoint has that this forward leaves out ("" where nothing): an o_proj or MLP bias
    (Llama's attention_bias and mlp_bias), or a sliding window shorter than the context (Mistral's, Qwen's
    use_sliding_window). Left out, its logits would differ from the model's, drafted or not alike."""
    cfg = hf_model.config
    found = []
    layers = hf_model.model.layers
    if any(layer.self_attn.o_proj.bias is not None for layer in layers):
        found.append("a bias on o_proj")
    if any(getattr(getattr(layer.mlp, name), "bias", None) is not None for layer in layers
           for name in ("gate_proj", "up_proj", "down_proj")):
        found.append("MLP biases")
    kinds = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    windowed = "sliding_attention" in kinds if kinds is not None else window is not None
    if windowed and window is not None and window < max_positions:
        found.append(f"a {window}-token sliding window")
    return " and ".join(found)


class DecoderModel:
    """Weights + forward of a decoder-only transformer; stateless apart from the cache it is handed."""

    def __init__(self, hf_model: torch.nn.Module, max_positions: int, fp32_prefill: bool | None = None) -> None:
        """`fp32_prefill`: compute prompts with an fp32 copy of bf16 weights (default: where the CPU lacks
        bf16 matrix instructions). Prompts are computed the same way with or without a drafter, so this
        changes speed, not exactness."""
        arch = type(hf_model).__name__
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        missing = unsupported_parts(hf_model, max_positions)
        if missing:
            raise ValueError(f"this {arch} has {missing}, which this forward does not compute")
        cfg = hf_model.config
        inner = hf_model.model
        self.dtype = inner.embed_tokens.weight.dtype
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.shape = ModelShape(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            vocab_size=hf_model.lm_head.weight.shape[0],
            rms_eps=cfg.rms_norm_eps,
            intermediate_size=inner.layers[0].mlp.down_proj.weight.shape[1],
        )
        self.max_positions = max_positions
        self.compiled: CompiledDecoder | None = None  # the compiled decode/verify forward, once attached
        self.kernel_path = "python"  # the compiled forward's kernel path, once attached
        self.exact_by_design = True  # rows computed alike whatever shares their pass: the probe confirms
        self.weights = Weights(
            embed_tokens=inner.embed_tokens.weight.detach(),
            layers=[self._layer_weights(layer) for layer in inner.layers],
            final_norm=inner.norm.weight.detach(),
            lm_head=hf_model.lm_head.weight.detach(),
        )
        if fp32_prefill is None:
            fp32_prefill = self.dtype == torch.bfloat16 and not has_fast_bf16_matmul()
        self.prefill_weights = self.weights.with_layers_in(torch.float32) if fp32_prefill else self.weights
        # the cache (and so the table) ends on a bucket boundary; rows past max_positions are only padding
        self.rope = self._rope_table(inner.rotary_emb, -(-max_positions // ATTENTION_BUCKET) * ATTENTION_BUCKET)

    def use_compiled(self, compiled: CompiledDecoder, weights: Weights | None = None,
                     prefill_weights: Weights | None = None) -> None:
        """Run decode/verify rows (and prompts, where it is fast for them) through `compiled`; `weights` and
        `prefill_weights`: what this Python forward computes with from then on (the values the compiled
        rows see, such as Q8_0 blocks', so that prompts torch computes see the same model)."""
        self.compiled, self.kernel_path = compiled, compiled.path
        self.weights = weights or self.weights
        # an fp32 copy for torch's prompt GEMMs is no longer read where the compiled forward takes prompts
        self.prefill_weights = self.weights if compiled.fast_for_prompts else prefill_weights or self.prefill_weights

    def linear_weights(self) -> list[torch.Tensor]:
        """The matrices a decode pass reads (every layer's linears and the head)."""
        w = self.weights
        return [t for layer in w.layers for t in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)] + [w.lm_head]

    def new_cache(self, num_slots: int, capacity: int) -> KVCache:
        s = self.shape
        return KVCache(s.num_layers, num_slots, s.num_kv_heads, capacity, s.head_dim, self.dtype)

    def interleave_rows(self, weight: torch.Tensor | None, heads: int) -> torch.Tensor | None:
        """Reorder each head's dims from HF's half-split rope layout to interleaved pairs, so RoPE is one
        complex multiply. q and k get the same order, so their dot products are unchanged."""
        if weight is None:
            return None
        d = self.shape.head_dim
        order = torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], dim=1).flatten()
        order = (torch.arange(heads)[:, None] * d + order[None]).flatten()
        return weight[order].detach()

    def _layer_weights(self, layer: torch.nn.Module) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        s = self.shape
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        return LayerWeights(
            input_norm=layer.input_layernorm.weight.detach(),
            qkv=torch.cat([
                self.interleave_rows(attn.q_proj.weight, s.num_heads),
                self.interleave_rows(attn.k_proj.weight, s.num_kv_heads),
                attn.v_proj.weight.detach(),
            ]),
            qkv_bias=None if attn.q_proj.bias is None else torch.cat([
                self.interleave_rows(attn.q_proj.bias, s.num_heads),
                self.interleave_rows(attn.k_proj.bias, s.num_kv_heads),
                attn.v_proj.bias.detach(),
            ]),
            o_proj=attn.o_proj.weight.detach(),
            q_norm=None if q_norm is None else self.interleave_rows(q_norm.weight, 1),
            k_norm=None if k_norm is None else self.interleave_rows(k_norm.weight, 1),
            post_attention_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
            down=mlp.down_proj.weight.detach(),
        )

    def _rope_table(self, rotary_emb: torch.nn.Module, max_positions: int) -> torch.Tensor:
        # The HF rotary module knows every rope variant (llama3, yarn, ...); sample it once, in fp32.
        cos, sin = rotary_emb(torch.empty(1), torch.arange(max_positions)[None])
        half = self.shape.head_dim // 2
        return torch.complex(cos[0, :, :half].float(), sin[0, :, :half].float())  # [positions, D/2]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps=self.shape.rms_eps)  # accumulates in fp32

    def forward(
        self,
        tokens: torch.Tensor,
        start_positions: list[int],
        slots: list[int],
        cache: KVCache,
        tap_layers: tuple[int, ...] = (),
        prefill: bool = False,
        logits_at: list[int] | None = None,
        real_rows: list[int] | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run `tokens` [B, T] at positions start..start+T-1 of each slot; write their K/V into the cache
        (keys/values [layers, slots, kv heads, capacity, D]: the model dtype, see KVCache). Rows of request
        b past `real_rows[b]` are padding: their K/V land past the slot's length and are never read.

        Returns fp32 logits [B, T, V] (or [B, 1, V] of row logits_at[b] of each request) and the hidden
        states of `tap_layers` (HF numbering: 0 is the embedding output, i the output of layer i,
        num_layers the final normed state before the head). `prefill` computes with the prefill weights.
        """
        weights = self.prefill_weights if prefill else self.weights
        alone = not prefill  # see `linear`; a prompt block has one shape, so its rows depend on it alone
        s = self.shape
        width = tokens.shape[1]
        positions = torch.tensor(start_positions)[:, None] + torch.arange(width)[None]
        if int(positions.max()) >= self.rope.shape[0]:
            raise ValueError(f"position {int(positions.max())} is past the rope table ({self.rope.shape[0]})")
        rope = self.rope[positions][:, :, None]  # [B, T, 1, D/2]
        runs = [attention_runs(start, width) for start in start_positions]
        taps: dict[int, torch.Tensor] = {}
        hidden = F.embedding(tokens, weights.embed_tokens).to(weights.final_norm.dtype)
        if 0 in tap_layers:
            taps[0] = hidden
        for index, layer in enumerate(weights.layers):
            attn_in = self.rms_norm(hidden, layer.input_norm)
            hidden = hidden + self._attention(attn_in, layer, rope, slots, start_positions, runs,
                                              cache.keys[index], cache.values[index], alone)
            mlp_in = self.rms_norm(hidden, layer.post_attention_norm)
            gate, up = linear(mlp_in, layer.gate_up, rows_alone=alone).chunk(2, dim=-1)
            hidden = hidden + linear(F.silu(gate) * up, layer.down, rows_alone=alone)
            if index + 1 in tap_layers and index + 1 != s.num_layers:
                taps[index + 1] = hidden
        hidden = self.rms_norm(hidden, weights.final_norm)
        if s.num_layers in tap_layers:
            taps[s.num_layers] = hidden
        if logits_at is not None:
            hidden = hidden[torch.arange(len(logits_at)), logits_at][:, None]
        return linear(hidden.to(weights.lm_head.dtype), weights.lm_head, rows_alone=alone).float(), taps

    def _attention(
        self,
        x: torch.Tensor,
        layer: LayerWeights,
        rope: torch.Tensor,
        slots: list[int],
        start_positions: list[int],
        runs: list[list[_AttentionRun]],
        keys: torch.Tensor,
        values: torch.Tensor,
        alone: bool,
    ) -> torch.Tensor:
        s = self.shape
        batch, width, _ = x.shape
        qkv = linear(x, layer.qkv, layer.qkv_bias, alone).view(batch, width, -1, s.head_dim)
        qk, v = qkv.split([s.num_heads + s.num_kv_heads, s.num_kv_heads], dim=2)
        if layer.q_norm is not None:
            q, k = qk.split([s.num_heads, s.num_kv_heads], dim=2)
            qk = torch.cat([self.rms_norm(q, layer.q_norm), self.rms_norm(k, layer.k_norm)], dim=2)
        # RoPE on interleaved pairs (see _interleave) is one complex multiply, done in fp32
        qk = torch.view_as_real(torch.view_as_complex(qk.float().unflatten(-1, (-1, 2))) * rope).flatten(-2)
        q, k = qk.transpose(1, 2).split([s.num_heads, s.num_kv_heads], dim=1)  # [B, heads, T, D]
        v = v.transpose(1, 2)
        outs = []
        for b, (slot, start) in enumerate(zip(slots, start_positions, strict=True)):
            slot_keys, slot_values = keys[slot], values[slot]
            slot_keys[:, start : start + width] = k[b]
            slot_values[:, start : start + width] = v[b]
            parts = [attend(q[b, :, r.row : r.row + r.rows], slot_keys, slot_values, r) for r in runs[b]]
            outs.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
        out = outs[0][None] if batch == 1 else torch.stack(outs)  # [B, H, T, D]
        out = out.to(x.dtype).transpose(1, 2).reshape(batch, width, s.q_size)
        return linear(out, layer.o_proj, rows_alone=alone)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, run: _AttentionRun,
           scale: float | None = None) -> torch.Tensor:
    """fp32 attention of query rows q [H, rows, D] over the first run.length cache positions (scores
    scaled by `scale`, default 1/sqrt(D)). Rows are zero-padded to a multiple of ATTENTION_ROW_BLOCK: fp32
    GEMMs round differently for small odd row counts, and the padding makes a 1-token pass and a verify
    pass run the same GEMM shapes."""
    padded = run.bias.shape[0]
    if padded != run.rows:
        q = F.pad(q, (0, 0, 0, padded - run.rows))
    keys, values = keys[None, :, : run.length].float(), values[None, :, : run.length].float()
    out = F.scaled_dot_product_attention(q[None], keys, values, attn_mask=run.bias, enable_gqa=True, scale=scale)
    return out[0, :, : run.rows]


def attention_runs(start: int, width: int, window: int | None = None) -> list[_AttentionRun]:
    """Split a request's rows into runs that attend over the same cache length.

    A row at position p always attends over the first roundup(p + 1, ATTENTION_BUCKET) cache positions,
    whatever pass it is in: the reduction length (which can change a GEMM's blocking, and so its
    rounding) is a function of the position alone, and short contexts do not pay for the full capacity.
    With a sliding `window`, a row sees only the keys at positions p - window + 1 .. p.
    """
    runs: list[_AttentionRun] = []
    row = 0
    while row < width:
        length = (start + row) // ATTENTION_BUCKET * ATTENTION_BUCKET + ATTENTION_BUCKET
        rows = min(width - row, length - (start + row))
        padded = -(-rows // ATTENTION_ROW_BLOCK) * ATTENTION_ROW_BLOCK
        # padding rows repeat the last real position, so they see valid keys only
        query_positions = start + row + torch.arange(padded).clamp_max(rows - 1)
        hidden = torch.arange(length) > query_positions[:, None]
        if window is not None:
            hidden |= torch.arange(length) <= query_positions[:, None] - window
        bias = torch.zeros(padded, length).masked_fill(hidden, float("-inf"))
        runs.append(_AttentionRun(row, rows, length, bias))
        row += rows
    return runs
