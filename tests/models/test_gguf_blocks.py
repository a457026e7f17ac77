"""A GGUF's linears in the Q8_0 form the kernels read: integer blocks kept bit for bit, names and row
orders mapped to transformers', everything checked against gguf's own reference dequantization."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from specstand.kernels import q8_0
from specstand.models import gguf_blocks

KINDS = [Q.Q8_0, Q.Q5_0, Q.Q4_0]


@pytest.mark.parametrize("kind", KINDS)
def test_integer_blocks_are_the_published_values_bit_for_bit(kind):
    values = np.random.default_rng(int(kind)).standard_normal((24, 96)).astype(np.float32)
    raw = gguf.quants.quantize(values, kind)
    q, d = gguf_blocks.integer_blocks(raw, kind.name, 96)
    assert q.dtype == torch.int8 and d.dtype == torch.float16
    assert torch.equal(q8_0.dequantize(q, d), torch.from_numpy(gguf.quants.dequantize(raw, kind)))
    assert (d < 0).any() if kind is Q.Q5_0 else True  # GGUF's scales carry the sign of the largest weight


def test_other_types_are_not_integer_blocks():
    raw = gguf.quants.quantize(np.ones((2, 256), np.float32), Q.Q4_1)
    assert gguf_blocks.integer_blocks(raw, "Q4_1", 256) is None


def _permuted(rows: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to a llama q/k weight (half-split rope -> pairs), written here from
    its description: each head's rows regrouped."""
    n = rows.shape[0]
    return rows.reshape(heads, 2, n // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _tiny_gguf(path, arch: str, weights: dict[str, np.ndarray], kinds: dict[str, Q]) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.attention.head_count", 4)
    writer.add_uint32(f"{arch}.attention.head_count_kv", 2)
    for name, value in weights.items():
        kind = kinds.get(name, Q.F32)
        data = value.astype(np.float32) if kind is Q.F32 else gguf.quants.quantize(value.astype(np.float32), kind)
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_write_maps_names_and_rows_and_requantizes_the_rest(tmp_path, arch):
    rng = np.random.default_rng(5)
    hf = {  # transformers layout: q 4 heads x 16 dims, k 2 heads x 16, over a hidden size of 64
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((64, 64)),
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((32, 64)),
        "model.layers.0.mlp.down_proj.weight": rng.standard_normal((64, 256)),
        "lm_head.weight": rng.standard_normal((40, 64)),
    }
    permute = arch == "llama"
    published = {
        "blk.0.attn_q.weight": _permuted(hf["model.layers.0.self_attn.q_proj.weight"], 4) if permute
        else hf["model.layers.0.self_attn.q_proj.weight"],
        "blk.0.attn_k.weight": _permuted(hf["model.layers.0.self_attn.k_proj.weight"], 2) if permute
        else hf["model.layers.0.self_attn.k_proj.weight"],
        "blk.0.ffn_down.weight": hf["model.layers.0.mlp.down_proj.weight"],
        "output.weight": hf["lm_head.weight"],
        "blk.0.attn_norm.weight": np.ones(64),  # not a linear: left out
    }
    kinds = {"blk.0.attn_q.weight": Q.Q5_0, "blk.0.attn_k.weight": Q.Q8_0, "blk.0.ffn_down.weight": Q.Q4_1,
             "output.weight": Q.Q4_0}
    _tiny_gguf(tmp_path / "model.gguf", arch, published, kinds)
    counts = gguf_blocks.write(tmp_path / "model.gguf", tmp_path / gguf_blocks.FILE)
    assert counts == {"published": 3, "requantized": 1}
    blocks = gguf_blocks.read(tmp_path)
    assert sorted(blocks) == sorted(hf)
    for name, weight in hf.items():
        q, d = blocks[name]
        assert q.shape == weight.shape
        # every format here is within a step of 4-bit quantization of the original values
        step = np.abs(weight).reshape(weight.shape[0], -1, 32).max(axis=2).repeat(32, axis=1) / 6
        assert (np.abs(q8_0.dequantize(q, d).numpy() - weight) <= step).all(), name
    reader = gguf.GGUFReader(str(tmp_path / "model.gguf"))
    raw = {t.name: t for t in reader.tensors}["blk.0.attn_k.weight"]  # Q8_0: kept as published
    exact = torch.from_numpy(gguf.quants.dequantize(raw.data, raw.tensor_type).reshape(32, 64).copy())
    if permute:  # back in transformers' row order: GGUF row i is transformers row order[i]
        order = torch.from_numpy(_permuted(np.arange(32)[:, None], 2)[:, 0].copy())
        exact = torch.empty_like(exact).index_copy_(0, order, exact)
    assert torch.equal(q8_0.dequantize(*blocks["model.layers.0.self_attn.k_proj.weight"]), exact)


def test_other_architectures_are_refused(tmp_path):
    _tiny_gguf(tmp_path / "model.gguf", "gemma3", {"output.weight": np.ones((32, 64))}, {})
    with pytest.raises(ValueError, match="gemma3"):
        gguf_blocks.write(tmp_path / "model.gguf", tmp_path / gguf_blocks.FILE)
