"""A preset's linear weights as its GGUF publishes them, in the Q8_0 form the kernels read.

GGUF's Q8_0, Q5_0 and Q4_0 blocks are each 32 weights of one row sharing an fp16 scale d, every weight
d x (an integer of 8, 5 or 4 bits): an int8 holds each integer, so those matrices are kept exactly as
published. Other types (Q4_1, Q4_K, Q6_K, ...) have offsets or finer scales that Q8_0 cannot hold: they are
dequantized exactly (gguf's own reference) and quantized to Q8_0 (kernels/q8_0.py), a step finer than the
published 4-6 bits. `write` saves them under the transformers names in a subfolder of the converted model
(`gguf_blocks/q8_0.safetensors`: vLLM loads every `*.safetensors` at a model folder's top, and would take
the blocks for weights); `--dtype q8_0` reads them instead of quantizing the bf16 copy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specstand.kernels import q8_0

FILE = "gguf_blocks/q8_0.safetensors"  # under the model folder
ARCHITECTURES = ("llama", "qwen2")  # GGUF names mapped below; llama's q/k rows are permuted by its converter
_LINEARS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str | None:
    """The transformers name of a GGUF linear weight (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`), or None for what is not a linear of a layer or the head."""
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LINEARS:
        return f"model.layers.{parts[1]}.{_LINEARS[parts[2]]}.weight"
    return None


def integer_blocks(data: np.ndarray, kind: str, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q int8 [n, k], d fp16 [n, k / 32]) of raw Q8_0 / Q5_0 / Q4_0 rows (uint8 [n, bytes]), bit for bit;
    None for any other type."""
    if kind not in ("Q8_0", "Q5_0", "Q4_0"):
        return None
    n, blocks = data.shape[0], k // 32
    raw = np.ascontiguousarray(data).reshape(n, blocks, -1)
    d = raw[:, :, :2].copy().view(np.float16).reshape(n, blocks)
    if kind == "Q8_0":
        q = raw[:, :, 2:34].copy().view(np.int8).astype(np.int8)
    elif kind in ("Q5_0", "Q4_0"):
        nibbles = raw[:, :, 6:22] if kind == "Q5_0" else raw[:, :, 2:18]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2).astype(np.int16)  # elements j, then j + 16
        if kind == "Q5_0":
            high = raw[:, :, 2:6].copy().view(np.uint32).reshape(n, blocks, 1)
            q |= (((high >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int16)
            q -= 16
        else:
            q -= 8
        q = q.astype(np.int8)
    return torch.from_numpy(q.reshape(n, k).copy()), torch.from_numpy(d.copy())


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter, which reorders each head's q/k rows from transformers' half-split rope
    layout to pairs (a row permutation: it applies to q and d alike)."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write(gguf_path: Path, out_path: Path) -> dict[str, int]:
    """Save every linear of the GGUF (llama/qwen2) as Q8_0 blocks under its transformers name; returns how
    many were kept as published and how many were requantized. Raises ValueError for other architectures."""
    import gguf
    import safetensors.torch

    reader = gguf.GGUFReader(str(gguf_path))

    def field(key: str):
        value = reader.fields[key]
        return value.contents() if hasattr(value, "contents") else value.parts[value.data[0]].tolist()

    arch = field("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r}: its names are not mapped (only {', '.join(ARCHITECTURES)})")
    heads, kv_heads = int(field(f"{arch}.attention.head_count")), int(field(f"{arch}.attention.head_count_kv"))
    names = {t.name for t in reader.tensors}
    tensors, counts = {}, {"published": 0, "requantized": 0}
    for t in reader.tensors:
        name = hf_name(t.name) or ("lm_head.weight" if t.name == "token_embd.weight" and "output.weight" not in names
                                   else None)
        if name is None:
            continue
        k, n = (int(x) for x in t.shape[:2])
        blocks = integer_blocks(t.data, t.tensor_type.name, k) if k % 32 == 0 else None
        if blocks is None:
            values = torch.from_numpy(np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
            blocks = q8_0.quantize(values.reshape(n, k))
            counts["requantized"] += 1
        else:
            counts["published"] += 1
        q, d = blocks
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            groups = heads if "q_proj" in name else kv_heads
            q, d = _unpermute(q, groups), _unpermute(d, groups)
        tensors[f"{name}.q"], tensors[f"{name}.d"] = q.contiguous(), d.contiguous()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(out_path), metadata={k: str(v) for k, v in counts.items()})
    return counts


def verify(folder: Path) -> None:
    """Check the saved blocks against the converted bf16 weights (transformers' own reading of the GGUF): a
    matrix kept as published dequantizes to exactly them once rounded to bf16, a requantized one lies within
    a step of them. Raises RuntimeError naming the first matrix that does not (a wrong name or row order)."""
    import safetensors.torch

    converted = safetensors.torch.load_file(str(Path(folder) / "model.safetensors"))
    for name, (q, d) in (read(folder) or {}).items():
        weight = converted.get(name, converted.get("model.embed_tokens.weight") if name == "lm_head.weight" else None)
        if weight is None or weight.shape != q.shape:
            raise RuntimeError(f"{FILE}: {name} has no converted weight of its shape")
        values = q8_0.dequantize(q, d)
        step = d.float().abs().repeat_interleave(32, dim=1)[:, : q.shape[1]]  # GGUF scales may be negative
        # a step of the blocks plus bf16's rounding of the converted weight
        if ((values - weight.float()).abs() > step + weight.float().abs() * 2.0**-8).any():
            raise RuntimeError(f"{FILE}: {name} does not match the converted weights")


def describe(folder: Path) -> str:
    """How many matrices `write` kept as published and how many it requantized."""
    from safetensors import safe_open

    with safe_open(str(Path(folder) / FILE), "pt") as f:
        meta = f.metadata() or {}
    return f"{meta.get('published', '?')} matrices as published, {meta.get('requantized', '?')} requantized to Q8_0"


def read(folder: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """{transformers name: (q, d)} saved by `write` in a model folder, or None where there is none."""
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    import safetensors.torch

    tensors = safetensors.torch.load_file(str(path))
    return {name[:-2]: (tensors[name], tensors[name[:-2] + ".d"]) for name in tensors if name.endswith(".q")}
