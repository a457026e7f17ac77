"""The decode/verify attention kernel on every path this CPU runs: accuracy against float64 and row invariance."""

from __future__ import annotations

import math

import pytest
import torch

from specstand import kernels
from tests.conftest import KERNEL_PATHS

pytestmark = pytest.mark.skipif(not KERNEL_PATHS, reason="the kernels do not build on this machine")

# (heads, kv_heads, head_dim): SmolLM2 (group 3) and Qwen2.5-0.5B (group 7) widths, a 16-wide tiny twin, 32 (one
# 32-dim half in the tiles' scores, two 16-dim blocks in their values), 128
SHAPES = [(9, 3, 64), (14, 2, 64), (4, 2, 16), (4, 2, 32), (4, 1, 128)]
CAPACITY = 300


def _cache(kv_heads: int, head_dim: int, slots: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (slots, kv_heads, CAPACITY, head_dim)
    return (torch.randn(shape, generator=generator).bfloat16(), torch.randn(shape, generator=generator).bfloat16())


def _attend(path: str, q, keys, values, slots: list[int], positions: list[int], scale: float) -> torch.Tensor:
    return kernels.attention(q, keys, values, torch.tensor(slots), torch.tensor(positions), scale, path)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("shape", SHAPES)
def test_attention_matches_a_float64_reference(path, shape):
    heads, kv_heads, head_dim = shape
    keys, values = _cache(kv_heads, head_dim, 2, seed=head_dim)
    positions = [0, 5, 7, 8, 63, 130, 299]  # block edges of 8 and 16 keys, and a full cache
    slots = [i % 2 for i in range(len(positions))]
    q = torch.randn(len(positions), heads * head_dim, generator=torch.Generator().manual_seed(1))
    scale = 1 / math.sqrt(head_dim)
    out = _attend(path, q, keys, values, slots, positions, scale).double()
    # amx and avx512bf16 round queries and softmax numerators to bf16 at head_dim 32, 64 and 128 (their tile
    # products take bf16); the other paths and widths keep fp32
    rounded = path in ("amx", "avx512bf16") and head_dim in (32, 64, 128)
    group = heads // kv_heads
    for r, (slot, position) in enumerate(zip(slots, positions, strict=True)):
        for h in range(heads):
            qh = q[r, h * head_dim : (h + 1) * head_dim]
            qh = (qh.bfloat16() if rounded else qh).double()
            k = keys[slot, h // group, : position + 1].double()
            v = values[slot, h // group, : position + 1].double()
            products = (qh * k).abs().sum(-1) * scale
            p = torch.softmax(k @ qh * scale, 0)
            exact = p @ v
            # fp32: each score off by at most head_dim rounding steps of its |products|, which moves a weight
            # by twice that relatively (4x: margin); exp within a few ulp; the sums over keys and the division
            # by (position + head_dim + 24) steps of 2^-23; bf16 numerators (tiles) 2^-8 more
            score_error = head_dim * 2.0**-23 * float(products.max())
            relative = 4 * score_error + (position + head_dim + 24) * 2.0**-23 + (2.0**-8 if rounded else 0)
            bound = relative * (p @ v.abs()) + 1e-30
            got = out[r, h * head_dim : (h + 1) * head_dim]
            assert ((got - exact).abs() <= bound).all(), (r, h, float((got - exact).abs().max()), float(bound.min()))


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_row_gives_the_bits_it_gives_alone(path, shape):
    """One request's 1..64 consecutive rows (a verify, a prompt chunk) and a mix of three requests at other
    lengths: each row equals that row computed alone."""
    heads, kv_heads, head_dim = shape
    keys, values = _cache(kv_heads, head_dim, 3, seed=7)
    scale = 1 / math.sqrt(head_dim)
    slots = [0] * 64 + [1] * 5 + [2] * 3
    positions = list(range(200, 264)) + list(range(17, 22)) + [290, 291, 292]
    q = torch.randn(len(slots), heads * head_dim, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([_attend(path, q[r : r + 1], keys, values, slots[r : r + 1], positions[r : r + 1], scale)
                       for r in range(len(slots))])
    for rows in (1, 2, 3, 5, 8, 13, 31, 64):
        together = _attend(path, q[:rows], keys, values, slots[:rows], positions[:rows], scale)
        assert torch.equal(together, alone[:rows]), rows
    mixed = _attend(path, q, keys, values, slots, positions, scale)
    assert torch.equal(mixed, alone)
