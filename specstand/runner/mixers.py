"""Token mixers of the hybrid families (hybrid.py): attention (global or sliding-window, optionally
gated), gated short convolution (LFM2) and the gated delta rule (Qwen3.5's linear attention).

Every op is row-local or runs token by token in a fixed order, so a row computes the same whatever else
shares its pass (the same contract as transformer.py). Recurrent mixers read their state at the slot's
length from the StateCache and hand it the state after each row it asks for (`rows_to_keep`); they never
update a state tensor in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specstand.kernels import q8_0
from specstand.runner.state_cache import StateCache
from specstand.runner.transformer import _AttentionRun, attend, attention_runs, linear


class Linear:
    """y = x W^T (+ b), in the model dtype. Packed for a compiled kernel path (`pack`), every row is
    computed by the same instruction sequence whatever the row count (batch-invariant by construction,
    fp32 accumulation); otherwise torch's F.linear: bf16 rows of a pass that is not a prompt's each alone
    (transformer.linear), fp32 ones as the start-up probe finds them."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.packed = None  # the kernels' packed copy of `weight`, once packed

    def pack(self, module, isa: int, weight_format: str = "bf16") -> None:
        """Pack for kernel path `isa`; q8_0 quantizes to Q8_0 blocks, and `weight` (torch's fallback and the
        taps' reference) becomes the values they stand for."""
        if weight_format == "q8_0":
            q, d = q8_0.quantize(self.weight)
            self.packed = module.Linear(q, d, isa)
            self.weight = q8_0.dequantize(q, d).to(self.weight.dtype)
        else:
            self.packed = module.Linear(self.weight, isa)

    def __call__(self, x: torch.Tensor, rows_alone: bool = False) -> torch.Tensor:
        """`rows_alone`: a pass whose rows must not depend on each other's count (see transformer.linear);
        packed kernels are row-invariant anyway."""
        if self.packed is None:
            return linear(x, self.weight, self.bias, rows_alone)
        y = self.packed.forward(x)  # fp32
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)


@dataclass
class Norm:
    """RMSNorm over the last dim, in fp32. `offset` 1 scales by (1 + weight) in fp32 and rounds once
    (Gemma, Qwen3.5); 0 rounds the normed value first and scales in the model dtype (Llama, LFM2)."""

    weight: torch.Tensor
    eps: float
    offset: float = 0.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (normed * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)


@dataclass
class PassContext:
    """What a pass's mixers share: where each request's rows sit and the cache they read and write."""

    start_positions: list[int]
    slots: list[int]
    real_rows: list[int]
    cache: StateCache
    prompt: bool  # a prompt pass keeps fewer recurrent states (see StateCache.rows_to_keep)
    _runs: dict[int | None, list[list[_AttentionRun]]]
    _real_masks: dict[int, torch.Tensor]

    @classmethod
    def build(cls, start_positions: list[int], slots: list[int], real_rows: list[int], cache: StateCache,
              prompt: bool) -> PassContext:
        return cls(start_positions, slots, real_rows, cache, prompt, {}, {})

    @property
    def rows_alone(self) -> bool:
        """Whether torch's linears compute each row alone: in every pass but a prompt's (a prompt block
        has one shape, so its rows depend on the block alone)."""
        return not self.prompt

    def real_mask(self, width: int) -> torch.Tensor:
        """[requests * width] bool: which rows of the pass (flattened request by request) are real, not padding;
        built once a pass, as every sparse-expert layer asks for it."""
        if width not in self._real_masks:
            self._real_masks[width] = (torch.arange(width)[None] < torch.tensor(self.real_rows)[:, None]).reshape(-1)
        return self._real_masks[width]

    def rows_to_keep(self, start: int, real: int) -> list[int]:
        return self.cache.rows_to_keep(start, real, every_row=not self.prompt)

    def runs(self, width: int, window: int | None) -> list[list[_AttentionRun]]:
        if window not in self._runs:
            self._runs[window] = [attention_runs(start, width, window) for start in self.start_positions]
        return self._runs[window]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in HF's half-split layout on the first cos.shape[-1] dims of each head (partial rotary), fp32."""
    dims = cos.shape[-1]
    rot, rest = x[..., :dims].float(), x[..., dims:].float()
    half = dims // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


@dataclass
class Attention:
    q: Linear  # [heads * D (* 2 with a gate: per head, D query dims then D gate dims), hidden]
    k: Linear
    v: Linear
    o: Linear
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_layer: int  # this layer's index among the cache's attention layers
    cos: torch.Tensor  # [positions, rotary dims] fp32
    sin: torch.Tensor
    scale: float
    window: int | None = None  # sliding-window layers see the last `window` positions
    q_norm: Norm | None = None
    k_norm: Norm | None = None
    gated: bool = False  # Qwen3.5: output * sigmoid(gate), the gate computed beside the query

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, ctx: PassContext) -> torch.Tensor:
        batch, width, _ = x.shape
        d = self.head_dim
        q = self.q(x, ctx.rows_alone).view(batch, width, self.num_heads, -1)
        gate = None
        if self.gated:
            q, gate = q.split([d, d], dim=-1)
            gate = gate.reshape(batch, width, -1)
        k = self.k(x, ctx.rows_alone).view(batch, width, self.num_kv_heads, d)
        v = self.v(x, ctx.rows_alone).view(batch, width, self.num_kv_heads, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]
        q, k = _rotate(q, cos, sin).transpose(1, 2), _rotate(k, cos, sin).transpose(1, 2)  # [B, heads, T, D]
        v = v.transpose(1, 2)
        keys, values = ctx.cache.keys[self.kv_layer], ctx.cache.values[self.kv_layer]
        runs = ctx.runs(width, self.window)
        outs = []
        for b, (slot, start) in enumerate(zip(ctx.slots, ctx.start_positions, strict=True)):
            keys[slot, :, start : start + width] = k[b]
            values[slot, :, start : start + width] = v[b]
            parts = [attend(q[b, :, r.row : r.row + r.rows], keys[slot], values[slot], r, self.scale) for r in runs[b]]
            outs.append(torch.cat(parts, dim=1))
        out = torch.stack(outs).to(x.dtype).transpose(1, 2).reshape(batch, width, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o(out, ctx.rows_alone)


def _causal_conv(window: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """Depthwise causal convolution, fp32: row t = sum_j weight[:, j] * window[t + j], summed in the
    order of j, where `window` [taps - 1 + rows, C] holds the previous inputs then this pass's."""
    taps = weight.shape[1]
    w = weight.float()
    out = w[:, 0] * window[0:rows].float()
    for j in range(1, taps):
        out = out + w[:, j] * window[j : j + rows].float()
    return out


def linears_of(part: object) -> list[Linear]:
    """The Linear fields of a mixer or MLP."""
    return [value for value in vars(part).values() if isinstance(value, Linear)]


@dataclass
class ShortConv:
    """LFM2's gated short convolution: B, C, x = in_proj(h); y = out_proj(C * conv(B * x)). Its state
    is the last taps - 1 values of B * x."""

    in_proj: Linear  # [3 * hidden, hidden]
    conv: torch.Tensor  # [hidden, taps]
    conv_bias: torch.Tensor | None
    out_proj: Linear
    state: int  # index of its state in the cache

    def state_specs(self, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [((self.conv.shape[1] - 1, self.conv.shape[0]), dtype)]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, ctx: PassContext) -> torch.Tensor:
        b_, c_, x_ = self.in_proj(x, ctx.rows_alone).chunk(3, dim=-1)
        bx = b_ * x_
        taps = self.conv.shape[1]
        outs = []
        for b, (slot, start, real) in enumerate(zip(ctx.slots, ctx.start_positions, ctx.real_rows, strict=True)):
            window = torch.cat([ctx.cache.state(slot, self.state), bx[b]])
            conv = _causal_conv(window, self.conv, x.shape[1])
            if self.conv_bias is not None:
                conv = conv + self.conv_bias.float()
            outs.append(conv.to(x.dtype))
            kept = ctx.rows_to_keep(start, real)
            ctx.cache.record(slot, self.state, start, {t: window[t + 1 : t + taps] for t in kept})
        return self.out_proj(c_ * torch.stack(outs), ctx.rows_alone)


@dataclass
class GatedDeltaNet:
    """Qwen3.5's linear attention: a causal conv (SiLU) over [q; k; v], then per value head the gated
    delta rule S <- S * exp(g) + k (beta (v - S^T k))^T, read out as S^T q, then a gated RMSNorm (SiLU of
    z) and out_proj. State: the conv's last taps - 1 inputs and S [value heads, dk, dv] in fp32."""

    in_qkv: Linear  # [2 * key_dim + value_dim, hidden]
    in_z: Linear  # [value_dim, hidden]
    in_b: Linear  # [value heads, hidden]
    in_a: Linear
    conv: torch.Tensor  # [2 * key_dim + value_dim, taps]
    a_log: torch.Tensor  # [value heads]
    dt_bias: torch.Tensor
    norm: Norm  # over dv, then * silu(z)
    out_proj: Linear
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    state: int  # index of its conv state in the cache; S is state + 1

    def state_specs(self, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [((self.conv.shape[1] - 1, self.conv.shape[0]), dtype),
                ((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32)]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, ctx: PassContext) -> torch.Tensor:
        batch, width, _ = x.shape
        alone = ctx.rows_alone
        mixed = self.in_qkv(x, alone)
        z = self.in_z(x, alone).view(batch, width, self.num_v_heads, self.head_v_dim)
        beta = torch.sigmoid(self.in_b(x, alone)).float()
        decay = -self.a_log.float().exp() * F.softplus(self.in_a(x, alone).float() + self.dt_bias.float())
        taps = self.conv.shape[1]
        outs = []
        for b, (slot, start, real) in enumerate(zip(ctx.slots, ctx.start_positions, ctx.real_rows, strict=True)):
            window = torch.cat([ctx.cache.state(slot, self.state), mixed[b]])
            qkv = F.silu(_causal_conv(window, self.conv, width)).to(x.dtype)
            kept = ctx.rows_to_keep(start, real)
            ctx.cache.record(slot, self.state, start, {t: window[t + 1 : t + taps] for t in kept})
            out, states = self._delta_rule(qkv, beta[b], decay[b], ctx.cache.state(slot, self.state + 1), real)
            ctx.cache.record(slot, self.state + 1, start, {t: states[t] for t in kept})
            outs.append(out)
        core = torch.stack(outs)  # [B, T, value heads, dv] fp32
        gated = self.norm(core) * F.silu(z.float())
        return self.out_proj(gated.to(x.dtype).reshape(batch, width, -1), alone)

    def _delta_rule(self, qkv: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor, state: torch.Tensor,
                    real: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Token by token over one request's first `real` rows; returns the outputs [T, value heads, dv] (zeros
        past `real`) and the state after each real row. Rows past `real` pad the pass to its fixed shape (a
        prompt's last block, a plain decoding step's K rows): no real row depends on them, so they are skipped."""
        width = qkv.shape[0]
        key_dim = self.num_k_heads * self.head_k_dim
        q, k, v = qkv.float().split([key_dim, key_dim, self.num_v_heads * self.head_v_dim], dim=-1)
        q = q.view(width, self.num_k_heads, self.head_k_dim)
        k = k.view(width, self.num_k_heads, self.head_k_dim)
        v = v.view(width, self.num_v_heads, self.head_v_dim)
        if self.num_v_heads != self.num_k_heads:  # each key head serves consecutive value heads
            q = q.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=1)
            k = k.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=1)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / self.head_k_dim**0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        out, states = torch.zeros_like(v), []
        for t in range(real):
            state = state * decay[t].exp()[:, None, None]
            remembered = (state * k[t][:, :, None]).sum(-2)
            delta = (v[t] - remembered) * beta[t][:, None]
            state = state + k[t][:, :, None] * delta[:, None, :]
            out[t] = (state * q[t][:, :, None]).sum(-2)
            states.append(state)
        return out, states
