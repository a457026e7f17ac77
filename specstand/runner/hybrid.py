"""Decoders whose layers are not all Llama attention: Gemma 3 (sliding-window layers beside global
ones, sandwich norms), LFM2 (gated short convolutions beside GQA), Qwen3.5 (Gated DeltaNet beside gated
attention) and Qwen3-Next (the same layers, with sparse experts), written on the Hugging Face weights like
transformer.py.

The runner sees the same interface as DecoderModel (`new_cache`, `forward`, `shape`, `weights`). Their
cache is a StateCache: K/V for the attention layers and, for recurrent layers, a state per slot with a
checkpoint after every row of a verify pass, so a rejected draft rolls back exactly. No whole-layer
compiled forward: the Python one, with every projection through the compiled batch-invariant linear
where the kernels build (`attach_kernels`); the start-up probe checks exactness as for the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specstand import kernels
from specstand.runner.kv_cache import PREFILL_BLOCK
from specstand.runner.mixers import Attention, GatedDeltaNet, Linear, Norm, PassContext, ShortConv, linears_of
from specstand.runner.state_cache import StateCache
from specstand.runner.transformer import ATTENTION_BUCKET, ModelShape

Mixer = Attention | ShortConv | GatedDeltaNet


@dataclass
class GatedMLP:
    gate_up: Linear  # gate and up projections stacked
    down: Linear
    activation: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor, rows_alone: bool = False) -> torch.Tensor:
        gate, up = self.gate_up(x, rows_alone).chunk(2, dim=-1)
        return self.down(self.activation(gate) * up, rows_alone)

    def in_pass(self, x: torch.Tensor, ctx: PassContext) -> torch.Tensor:
        """A layer's MLP step: its linears take every row at once, padding included."""
        return self(x, ctx.rows_alone)

    def linears(self) -> list[Linear]:
        return linears_of(self)

    @property
    def width(self) -> int:
        return self.down.weight.shape[1]


@dataclass
class SparseMoE:
    """Qwen3-Next's MLP: each row's top-k experts by softmax router weight (renormalised where the model
    says so), summed in expert order, plus a shared expert scaled by a sigmoid gate. A row's experts and
    their order depend on the row alone. How many rows an expert gets depends on the others in the pass,
    so an expert runs on all its rows at once only where its linears are packed (batch-invariant);
    on torch's linears it runs one row at a time, real rows only (no real row depends on a padding row)."""

    router: Linear  # [experts, hidden]
    experts: list[GatedMLP]
    top_k: int
    normalise: bool
    shared: GatedMLP
    shared_gate: Linear  # [1, hidden]

    def __call__(self, x: torch.Tensor, rows_alone: bool = False, real: torch.Tensor | None = None) -> torch.Tensor:
        """`real`: which rows of x (flattened) are real, the rest padding (None: all)."""
        rows = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(torch.softmax(self.router(rows, rows_alone).float(), dim=-1), self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(rows)
        for index in chosen.unique().tolist():  # ascending: every row sums its experts in the same order
            row, slot = torch.nonzero(chosen == index, as_tuple=True)
            expert = self.experts[index]
            if expert.down.packed is not None:
                y = expert(rows[row])
            else:
                if real is not None:
                    kept = real[row]
                    row, slot = row[kept], slot[kept]
                    if not len(row):
                        continue
                y = torch.cat([expert(rows[r : r + 1]) for r in row.tolist()])
            out.index_add_(0, row, y * weights[row, slot, None])
        out = out + torch.sigmoid(self.shared_gate(rows, rows_alone)) * self.shared(rows, rows_alone)
        return out.reshape(x.shape)

    def in_pass(self, x: torch.Tensor, ctx: PassContext) -> torch.Tensor:
        """A layer's MLP step: experts on torch's linears skip the pass's padding rows."""
        return self(x, ctx.rows_alone, ctx.real_mask(x.shape[1]))

    def linears(self) -> list[Linear]:
        return [self.router, self.shared_gate, *self.shared.linears(),
                *(lin for expert in self.experts for lin in expert.linears())]

    @property
    def width(self) -> int:
        return self.shared.width


@dataclass
class HybridLayer:
    mixer_norm: Norm
    mixer: Mixer
    mlp_norm: Norm
    mlp: GatedMLP | SparseMoE
    post_mixer_norm: Norm | None = None  # Gemma's sandwich norms
    post_mlp_norm: Norm | None = None

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, ctx: PassContext) -> torch.Tensor:
        mixed = self.mixer(self.mixer_norm(hidden), positions, ctx)
        hidden = hidden + (mixed if self.post_mixer_norm is None else self.post_mixer_norm(mixed))
        out = self.mlp.in_pass(self.mlp_norm(hidden), ctx)
        return hidden + (out if self.post_mlp_norm is None else self.post_mlp_norm(out))


@dataclass
class HybridWeights:
    embed_tokens: torch.Tensor
    layers: list[HybridLayer]
    final_norm: Norm
    lm_head: torch.Tensor  # also read by drafters (their heads start from it)
    head: Linear  # lm_head as the forward applies it
    embed_scale: float | None = None  # Gemma scales embeddings by sqrt(hidden), rounded to the model dtype
    logit_softcap: float | None = None


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh, "gelu_tanh": _gelu_tanh}


class HybridModel:
    """Weights + forward of a Gemma 3, LFM2 or Qwen3.5 causal LM; stateless apart from its cache."""

    def __init__(self, hf_model: torch.nn.Module, max_positions: int) -> None:
        arch = type(hf_model).__name__
        cfg = hf_model.config
        inner = hf_model.model
        self.architecture = arch
        self.dtype = inner.embed_tokens.weight.dtype
        self.max_positions = max_positions
        self.compiled = None  # no whole-layer compiled forward: the Python one, with compiled linears
        self.kernel_path = "python"  # the projections' kernel path (attach_kernels)
        self.exact_by_design = True  # every op row-local or token by token: the probe confirms
        self.rotary = inner.rotary_emb  # sampled into each attention layer's cos/sin tables
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._table_len = -(-max_positions // ATTENTION_BUCKET) * ATTENTION_BUCKET
        self._kv_layers = 0
        self._state_specs: list[tuple[tuple[int, ...], torch.dtype]] = []
        layers = [FAMILIES[arch](self, cfg, layer, index) for index, layer in enumerate(inner.layers)]
        mlp = layers[0].mlp
        self.shape = ModelShape(
            num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim, vocab_size=hf_model.lm_head.weight.shape[0],
            rms_eps=_eps(cfg), intermediate_size=mlp.width,
        )
        final = inner.norm if hasattr(inner, "norm") else inner.embedding_norm  # LFM2 names it embedding_norm
        self.weights = HybridWeights(
            embed_tokens=inner.embed_tokens.weight.detach(),
            layers=layers,
            final_norm=Norm(final.weight.detach(), _eps(cfg), _norm_offset(arch)),
            lm_head=hf_model.lm_head.weight.detach(),
            head=Linear(hf_model.lm_head.weight.detach()),
            embed_scale=cfg.hidden_size**0.5 if arch == "Gemma3ForCausalLM" else None,
            logit_softcap=getattr(cfg, "final_logit_softcapping", None),
        )

    def linears(self) -> list[Linear]:
        """Every projection a pass applies: each layer's mixer and MLP, and the head."""
        found = []
        for layer in self.weights.layers:
            found += linears_of(layer.mixer)
            found += layer.mlp.linears()
        return [*found, self.weights.head]

    def linear_weights(self) -> list[torch.Tensor]:
        """The matrices a decode pass reads (every layer's projections and the head)."""
        return [lin.weight for lin in self.linears()]

    def attach_kernels(self, path: str, log=None, weight_format: str = "bf16") -> str:
        """Run every projection through the compiled batch-invariant linear of kernel `path` (chosen once, at
        load: kernels.chosen_path) where the model is bf16 and the path is not "python"; returns it, or
        "python" (the reason logged) where torch's linears stay. `weight_format` q8_0 runs Q8_0 blocks
        (and needs the kernels: raises KernelsUnavailable without them)."""
        try:
            if self.dtype != torch.bfloat16:
                raise kernels.KernelsUnavailable("the compiled linears take bf16 weights; this model is not bf16")
            if path == "python":
                raise kernels.KernelsUnavailable(kernels.chosen_path()[1] or "kernel path python: torch's linears")
            module = kernels.load()
            for lin in self.linears():
                lin.pack(module, kernels.PATHS[path], weight_format)
            self.kernel_path = path
            return path
        except kernels.KernelsUnavailable as reason:
            if weight_format != "bf16":
                raise
            if log is not None and self.dtype == torch.bfloat16:
                log(str(reason))
            return "python"

    def new_cache(self, num_slots: int, capacity: int) -> StateCache:
        s = self.shape
        return StateCache(max(self._kv_layers, 1), num_slots, s.num_kv_heads, capacity, s.head_dim, self.dtype,
                          self._state_specs, checkpoint_every=PREFILL_BLOCK)

    # -- building blocks the family loaders use --------------------------------------------------------

    def add_state(self, mixer: ShortConv | GatedDeltaNet) -> None:
        self._state_specs += mixer.state_specs(self.dtype)

    @property
    def next_state(self) -> int:
        return len(self._state_specs)

    def next_kv_layer(self) -> int:
        self._kv_layers += 1
        return self._kv_layers - 1

    def rope_tables(self, rotary_emb: torch.nn.Module, *args) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [positions, rotary dims] in fp32, sampled from the HF rotary module (it knows every
        rope variant; extra `args` such as Gemma's layer type are passed through)."""
        cos, sin = rotary_emb(torch.empty(1), torch.arange(self._table_len)[None], *args)
        return cos.reshape(self._table_len, -1).float(), sin.reshape(self._table_len, -1).float()

    # -- the forward -----------------------------------------------------------------------------------

    def forward(
        self,
        tokens: torch.Tensor,
        start_positions: list[int],
        slots: list[int],
        cache: StateCache,
        tap_layers: tuple[int, ...] = (),
        prefill: bool = False,
        logits_at: list[int] | None = None,
        real_rows: list[int] | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """As DecoderModel.forward; recurrent layers advance their state over the first real_rows[b] rows
        of request b only (the rest is padding), and save it where the cache asks."""
        w = self.weights
        width = tokens.shape[1]
        positions = torch.tensor(start_positions)[:, None] + torch.arange(width)[None]
        if int(positions.max()) >= self._table_len:
            raise ValueError(f"position {int(positions.max())} is past the rope table ({self._table_len})")
        ctx = PassContext.build(start_positions, slots, real_rows or [width] * len(slots), cache, prefill)
        hidden = F.embedding(tokens, w.embed_tokens)
        if w.embed_scale is not None:
            hidden = hidden * torch.tensor(w.embed_scale, dtype=hidden.dtype)
        taps: dict[int, torch.Tensor] = {0: hidden} if 0 in tap_layers else {}
        for index, layer in enumerate(w.layers):
            hidden = layer(hidden, positions, ctx)
            if index + 1 in tap_layers and index + 1 != self.shape.num_layers:
                taps[index + 1] = hidden
        hidden = w.final_norm(hidden)
        if self.shape.num_layers in tap_layers:
            taps[self.shape.num_layers] = hidden
        if logits_at is not None:
            hidden = hidden[torch.arange(len(logits_at)), logits_at][:, None]
        logits = w.head(hidden, ctx.rows_alone).float()
        if w.logit_softcap:
            logits = torch.tanh(logits / w.logit_softcap) * w.logit_softcap
        return logits, taps


def _eps(cfg) -> float:
    return getattr(cfg, "rms_norm_eps", None) or cfg.norm_eps


def _norm_offset(arch: str) -> float:
    return 0.0 if arch == "Lfm2ForCausalLM" else 1.0  # Gemma, Qwen3.5 and Qwen3-Next scale by (1 + weight)


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def _norm(module: torch.nn.Module, cfg, arch: str) -> Norm:
    return Norm(module.weight.detach(), _eps(cfg), _norm_offset(arch))


def _linear(module: torch.nn.Module) -> Linear:
    return Linear(module.weight.detach(), _detached(module.bias))


def _mlp(w1: torch.nn.Linear, w3: torch.nn.Linear, w2: torch.nn.Linear, activation: str) -> GatedMLP:
    """A gated MLP from its gate (w1), up (w3) and down (w2) projections."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not supported")
    return GatedMLP(Linear(torch.cat([w1.weight, w3.weight]).detach()), _linear(w2), ACTIVATIONS[activation])


def _attention(model: HybridModel, attn: torch.nn.Module, cfg, rope: tuple[torch.Tensor, torch.Tensor],
               q_norm, k_norm, arch: str, **kw) -> Attention:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    o = getattr(attn, "o_proj", None) or attn.out_proj
    return Attention(
        q=_linear(attn.q_proj), k=_linear(attn.k_proj), v=_linear(attn.v_proj), o=_linear(o),
        num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim, kv_layer=model.next_kv_layer(), cos=rope[0], sin=rope[1],
        q_norm=_norm(q_norm, cfg, arch), k_norm=_norm(k_norm, cfg, arch), **kw,
    )


def _gemma3_layer(model: HybridModel, cfg, layer: torch.nn.Module, index: int) -> HybridLayer:
    arch = "Gemma3ForCausalLM"
    if getattr(cfg, "attn_logit_softcapping", None) or getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("Gemma 3 with attention soft-capping or bidirectional attention is not supported")
    kind = cfg.layer_types[index]
    attn = layer.self_attn
    mixer = _attention(model, attn, cfg, model.rope_tables(model.rotary, kind), attn.q_norm, attn.k_norm, arch,
                       scale=attn.scaling, window=cfg.sliding_window if kind == "sliding_attention" else None)
    mlp = layer.mlp
    return HybridLayer(
        mixer_norm=_norm(layer.input_layernorm, cfg, arch), mixer=mixer,
        mlp_norm=_norm(layer.pre_feedforward_layernorm, cfg, arch),
        mlp=_mlp(mlp.gate_proj, mlp.up_proj, mlp.down_proj, cfg.hidden_activation),
        post_mixer_norm=_norm(layer.post_attention_layernorm, cfg, arch),
        post_mlp_norm=_norm(layer.post_feedforward_layernorm, cfg, arch),
    )


def _lfm2_layer(model: HybridModel, cfg, layer: torch.nn.Module, index: int) -> HybridLayer:
    arch = "Lfm2ForCausalLM"
    if layer.is_attention_layer:
        attn = layer.self_attn
        mixer = _attention(model, attn, cfg, model.rope_tables(model.rotary), attn.q_layernorm, attn.k_layernorm,
                           arch, scale=attn.scaling)
    else:
        conv = layer.conv
        mixer = ShortConv(_linear(conv.in_proj), conv.conv.weight.detach()[:, 0], _detached(conv.conv.bias),
                          _linear(conv.out_proj), state=model.next_state)
        model.add_state(mixer)
    ff = layer.feed_forward
    return HybridLayer(mixer_norm=_norm(layer.operator_norm, cfg, arch), mixer=mixer,
                       mlp_norm=_norm(layer.ffn_norm, cfg, arch), mlp=_mlp(ff.w1, ff.w3, ff.w2, "silu"))


def _qwen3_5_layer(model: HybridModel, cfg, layer: torch.nn.Module, index: int) -> HybridLayer:
    arch = "Qwen3_5ForCausalLM"
    if cfg.layer_types[index] == "linear_attention":
        net = layer.linear_attn
        mixer = _delta_net(model, net, _linear(net.in_proj_qkv), _linear(net.in_proj_z), _linear(net.in_proj_b),
                           _linear(net.in_proj_a))
    else:
        mixer = _gated_attention(model, layer.self_attn, cfg, arch)
    mlp = layer.mlp
    return HybridLayer(mixer_norm=_norm(layer.input_layernorm, cfg, arch), mixer=mixer,
                       mlp_norm=_norm(layer.post_attention_layernorm, cfg, arch),
                       mlp=_mlp(mlp.gate_proj, mlp.up_proj, mlp.down_proj, cfg.hidden_act))


def _qwen3_next_layer(model: HybridModel, cfg, layer: torch.nn.Module, index: int) -> HybridLayer:
    """Qwen3-Next: Qwen3.5's layers with the DeltaNet projections fused per key head, and sparse experts."""
    arch = "Qwen3NextForCausalLM"
    if cfg.layer_types[index] == "linear_attention":
        mixer = _delta_net(model, layer.linear_attn, *_unfused_qkvz_ba(layer.linear_attn))
    else:
        mixer = _gated_attention(model, layer.self_attn, cfg, arch)
    mlp = layer.mlp
    if hasattr(mlp, "experts"):
        experts = mlp.experts
        act = cfg.hidden_act
        moe = SparseMoE(
            router=Linear(mlp.gate.weight.detach()),
            experts=[GatedMLP(Linear(experts.gate_up_proj[e].detach()), Linear(experts.down_proj[e].detach()),
                              ACTIVATIONS[act]) for e in range(experts.num_experts)],
            top_k=mlp.gate.top_k, normalise=mlp.gate.norm_topk_prob,
            shared=_mlp(mlp.shared_expert.gate_proj, mlp.shared_expert.up_proj, mlp.shared_expert.down_proj, act),
            shared_gate=_linear(mlp.shared_expert_gate),
        )
    else:
        moe = _mlp(mlp.gate_proj, mlp.up_proj, mlp.down_proj, cfg.hidden_act)
    return HybridLayer(mixer_norm=_norm(layer.input_layernorm, cfg, arch), mixer=mixer,
                       mlp_norm=_norm(layer.post_attention_layernorm, cfg, arch), mlp=moe)


def _gated_attention(model: HybridModel, attn: torch.nn.Module, cfg, arch: str) -> Attention:
    return _attention(model, attn, cfg, model.rope_tables(model.rotary), attn.q_norm, attn.k_norm, arch,
                      scale=attn.scaling, gated=True)


def _delta_net(model: HybridModel, net: torch.nn.Module, in_qkv: Linear, in_z: Linear, in_b: Linear,
               in_a: Linear) -> GatedDeltaNet:
    mixer = GatedDeltaNet(
        in_qkv=in_qkv, in_z=in_z, in_b=in_b, in_a=in_a, conv=net.conv1d.weight.detach()[:, 0],
        a_log=net.A_log.detach(), dt_bias=net.dt_bias.detach(),
        norm=Norm(net.norm.weight.detach(), net.norm.variance_epsilon), out_proj=_linear(net.out_proj),
        num_k_heads=net.num_k_heads, num_v_heads=net.num_v_heads, head_k_dim=net.head_k_dim,
        head_v_dim=net.head_v_dim, state=model.next_state,
    )
    model.add_state(mixer)
    return mixer


def _unfused_qkvz_ba(net: torch.nn.Module) -> tuple[Linear, Linear, Linear, Linear]:
    """Qwen3-Next's in_proj_qkvz holds, per key head, [q (dk), k (dk), v (r dv), z (r dv)] (r value heads
    per key head), and in_proj_ba per key head [b (r), a (r)]: regroup the rows as Qwen3.5 lays them out
    (all q, all k, all v; z; b; a), which changes no output but its order."""
    nk, dk, dv, r = net.num_k_heads, net.head_k_dim, net.head_v_dim, net.num_v_heads // net.num_k_heads
    qkvz = net.in_proj_qkvz.weight.detach().view(nk, 2 * dk + 2 * r * dv, -1)
    q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=1)
    ba = net.in_proj_ba.weight.detach().view(nk, 2 * r, -1)
    b, a = ba.split([r, r], dim=1)
    return Linear(torch.cat([_rows(q), _rows(k), _rows(v)])), Linear(_rows(z)), Linear(_rows(b)), Linear(_rows(a))


def _rows(grouped: torch.Tensor) -> torch.Tensor:
    """[groups, rows per group, hidden] -> [rows, hidden], groups in order."""
    return grouped.reshape(-1, grouped.shape[-1]).contiguous()


FAMILIES: dict[str, Callable[[HybridModel, object, torch.nn.Module, int], HybridLayer]] = {
    "Gemma3ForCausalLM": _gemma3_layer,
    "Lfm2ForCausalLM": _lfm2_layer,
    "Qwen3_5ForCausalLM": _qwen3_5_layer,
    "Qwen3NextForCausalLM": _qwen3_next_layer,
}
