"""Building blocks of the trained drafters: a small Llama-style decoder layer whose attention can take
extra keys/values (DFlash's target context) and an arbitrary additive mask (training-time test, packed
rows, non-causal blocks). Parameter names follow Hugging Face Llama, so checkpoints map onto the
`speculators` tensor names one to one.

Drafter outputs need not be bit-exact (the target verifies every token), so this uses SDPA freely.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specstand import kernels
from specstand.drafters.target_parts import TargetParts


@dataclass
class DrafterSpec:
    """Everything needed to rebuild a trained drafter around its target (saved with the weights)."""

    method: str  # eagle3 | mtp | dflash | dspark | dflash2
    target: str  # the verifier: preset name or path
    target_architecture: str
    target_vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    rms_eps: float
    rope_theta: float
    tap_layers: list[int]  # target hidden states read (HF numbering: 0 = embeddings, L = final normed)
    draft_vocab_size: int
    block_size: int = 0  # block methods: block = last token + (block_size - 1) masks
    mask_token_id: int = 0  # block methods: the token id whose embedding marks a position to predict
    # block methods: True = block row k predicts position p+k+1 (the anchor row is the first draft; DSpark's
    # convention, block_size drafts), False = row k predicts p+k (row 0 only carries the anchor; DFlash's)
    sample_from_anchor: bool = False
    markov_rank: int = 0  # dspark: rank of the Markov head's logit bias
    enable_confidence_head: bool = False  # dspark: a head predicting each position's acceptance
    confidence_head_with_markov: bool = True  # dspark: the confidence head also reads the Markov embedding
    conv_kernel_size: int = 0  # dflash2: taps of the grouped dynamic causal convolutions
    conv_group_size: int = 16  # dflash2: channels sharing one dynamic delta
    selector_rank: int = 0  # dflash2: rank of the candidate selector's edge scores
    selector_top_k: int = 16  # dflash2: candidates per position
    train_steps: int = 3  # eagle3/mtp: unrolled steps of the training-time test
    qk_norm: bool = False  # RMSNorm of q and k per head (Qwen3-style layers, e.g. z-lab's DFlash drafters)
    trained: dict = field(default_factory=dict)  # data, steps, time, held-out figures (the model card)

    @property
    def block_drafts(self) -> int:
        """Drafts one drafter pass makes (block methods; 0 for the others)."""
        return self.block_size - (0 if self.sample_from_anchor else 1) if self.block_size else 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> DrafterSpec:
        return cls(**json.loads(text))


def append_keys_values(past: tuple[torch.Tensor, torch.Tensor] | None,
                       new: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [heads, T, D] of `new` rows after those of `past` (None: nothing yet)."""
    return new if past is None else (torch.cat([past[0], new[0]], 1), torch.cat([past[1], new[1]], 1))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, half-split layout, x [..., T, D] with positions [T]."""
    half = x.shape[-1] // 2
    freqs = positions.float()[:, None] / theta ** (torch.arange(half, dtype=torch.float32) / half)
    cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: DrafterSpec, input_size: int) -> None:
        super().__init__()
        self.spec = spec
        d = spec.head_dim
        self.q_proj = nn.Linear(input_size, spec.num_heads * d, bias=False)
        self.k_proj = nn.Linear(input_size, spec.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(input_size, spec.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(spec.num_heads * d, spec.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, spec.rms_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, spec.rms_eps) if spec.qk_norm else None

    def _heads(self, x: torch.Tensor, proj: nn.Linear, norm: RMSNorm | None) -> torch.Tensor:
        heads = proj(x).view(len(x), -1, self.spec.head_dim)
        return (heads if norm is None else norm(heads)).transpose(0, 1)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Roped keys and values [kv heads, T, D] of rows x [T, input]."""
        k = self._heads(x, self.k_proj, self.k_norm)
        return rope(k, positions, self.spec.rope_theta), self._heads(x, self.v_proj, None)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        bias: torch.Tensor | None,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Rows x [T, input] attend over `past` keys/values (first) and their own. `bias` [T, past + T] is
        added to the scores (None: every key visible). Returns the output and the rows' own keys/values."""
        own = self.keys_values(x, positions)
        return self.attend(x, positions, *append_keys_values(past, own), bias), own

    def attend(self, x: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        """Rows x [T, input] attend over `keys`/`values` [kv heads, S, D], `bias` [T, S] added to the scores
        (None: every key visible)."""
        q = rope(self._heads(x, self.q_proj, self.q_norm), positions, self.spec.rope_theta)
        mask = None if bias is None else bias.to(q.dtype)
        out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, enable_gqa=True)[0]
        return self.o_proj(out.transpose(0, 1).reshape(len(x), -1))


    def attend_segments(self, x: torch.Tensor, positions: torch.Tensor, pasts: list[tuple | None],
                        sizes: list[int], causal: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Rows x [sum(sizes), input] in segments, segment r attending over its own `pasts[r]` keys/values
        (None: none yet) and its own rows (causally or not). One projection for all rows; attention per
        segment. Returns the output and the rows' own keys/values."""
        q = rope(self._heads(x, self.q_proj, self.q_norm), positions, self.spec.rope_theta)
        k, v = self.keys_values(x, positions)
        outs, start = [], 0
        for past, size in zip(pasts, sizes, strict=True):
            rows = slice(start, start + size)
            start += size
            keys, values = append_keys_values(past, (k[:, rows], v[:, rows]))
            mask = None
            if causal and size > 1:  # row i sees the past and its segment's rows up to i
                mask = torch.ones(size, keys.shape[1], dtype=torch.bool).tril(keys.shape[1] - size)
            outs.append(F.scaled_dot_product_attention(q[None, :, rows], keys[None], values[None], attn_mask=mask,
                                                       enable_gqa=True)[0])
        return self.o_proj(torch.cat(outs, 1).transpose(0, 1).reshape(len(x), -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP. `attention_input` is 2H for EAGLE-3's layer (embedding ++ hidden)."""

    def __init__(self, spec: DrafterSpec, attention_input: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_eps)
        self.self_attn = Attention(spec, attention_input or spec.hidden_size)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_eps)
        self.mlp = MLP(spec)

    def mlp_block(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class KernelLinear(nn.Module):
    """nn.Linear for inference: the weight packed once as bf16 for the CPU kernels (fp32 accumulation), which
    read half the bytes of torch's fp32 GEMV (benchmarks/linear_vs_torch.py: 1.8x faster at 1 row and 5x at
    8 on the AMX Xeon). Keeps the fp32 parameters, so the state dict is unchanged; never trained."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, path: str) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.packed = kernels.pack(weight, path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.packed.forward(x)
        return y if self.bias is None else y + self.bias


def pack_for_inference(model: nn.Module, path: str) -> str:
    """Run a loaded drafter's linears (and the head rows it borrows from the target) on kernel `path`, the
    target's; returns it ("python": torch's fp32 linears stay)."""
    if path == "python":
        return path
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, KernelLinear(child.weight, child.bias, path))
        if isinstance(module, TargetParts):
            module.pack_head(path)
    return path


def draft_vocabulary(response_ids: list[list[int]], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent response tokens (ties broken by id), sorted: draft id -> target id."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids in response_ids:
        counts += torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab_size)
    size = min(size, vocab_size)
    order = torch.argsort(-counts * vocab_size + torch.arange(vocab_size))  # by count, then by id
    return torch.sort(order[:size]).values


def document_bias(query_docs: torch.Tensor, key_docs: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Additive mask: 0 where `visible` and both rows belong to the same packed document, else -inf."""
    allowed = visible & (query_docs[:, None] == key_docs[None, :])
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))


def draw_drafts(logits: torch.Tensor, temperature: float, generator: torch.Generator, draft_to_target: torch.Tensor,
                vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent draws from softmax(logits / T) per row (logits [n, columns], `draft_to_target` the target
    id of each column: the draft vocabulary, or a row's candidates): the drawn columns [n] and q
    [n, vocab_size] scattered onto the target's vocabulary (what the rejection rule needs)."""
    q = torch.softmax(logits.float() / temperature, -1)
    drawn = torch.multinomial(q, 1, generator=generator).squeeze(-1)
    # added, not copied: columns that map to one target id (a row's candidates may repeat one) are one draw
    full = torch.zeros(len(q), vocab_size).index_add_(1, draft_to_target, q)
    return drawn, full
