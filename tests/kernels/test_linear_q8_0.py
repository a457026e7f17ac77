"""The Q8_0 linear on every path this CPU runs: the blocks as GGUF defines them, accuracy against a float64
reference of the same arithmetic, and batch invariance."""

from __future__ import annotations

import pytest
import torch

from specstand import kernels
from specstand.kernels import q8_0
from tests.conftest import KERNEL_PATHS

pytestmark = pytest.mark.skipif(not KERNEL_PATHS, reason="the kernels do not build on this machine")

# (n, k): model-like, ragged (n not a multiple of 16, k not a multiple of 32), one input column
SHAPES = [(96, 64), (37, 45), (130, 1)]


def _fixed_point(x: torch.Tensor) -> torch.Tensor:
    """Activations as every path sees them: per row and block of 32, rounded to a grid of step 2^e, the
    smallest power of two that keeps the block's largest |x| within 32639 steps."""
    rows, k = x.shape
    blocks = -(-k // 32)
    padded = torch.zeros(rows, blocks * 32, dtype=torch.float64)
    padded[:, :k] = x.double()
    padded = padded.view(rows, blocks, 32)
    largest = padded.abs().amax(dim=2, keepdim=True)
    _, exponent = torch.frexp((largest / 32639).float())
    step = torch.ldexp(torch.ones_like(largest), exponent.double())
    fixed = torch.where(largest > 0, torch.round(padded / step) * step, torch.zeros_like(padded))
    return fixed.view(rows, blocks * 32)[:, :k]


def test_quantize_follows_gguf_q8_0():
    weight = torch.randn(5, 70) * torch.logspace(-2, 1, 5)[:, None]
    weight[1, 32:64] = 0.0  # an all-zero block keeps scale 0
    q, d = q8_0.quantize(weight)
    assert q.dtype == torch.int8 and q.shape == (5, 70) and d.dtype == torch.float16 and d.shape == (5, 3)
    blocks = torch.nn.functional.pad(weight, (0, 26)).view(5, 3, 32)
    assert torch.equal(d, (blocks.abs().amax(dim=2) / 127).half())
    assert q.abs().max() <= 127 and d[1, 1] == 0 and (q[1, 32:64] == 0).all()
    values = q8_0.dequantize(q, d)
    assert torch.equal(values.double(), q.double() * d.double().repeat_interleave(32, dim=1)[:, :70])  # exact
    assert ((values - weight).abs() <= d.float().repeat_interleave(32, dim=1)[:, :70] / 2 * 1.001).all()


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("shape", SHAPES)
def test_q8_0_linear_matches_a_float64_reference(path, shape):
    n, k = shape
    generator = torch.Generator().manual_seed(n * 1000 + k)
    q, d = q8_0.quantize(torch.randn(n, k, generator=generator))
    weight = q8_0.dequantize(q, d).double()
    x = torch.randn(9, k, generator=generator) * torch.logspace(-4, 4, 9)[:, None]
    y = kernels.linear_q8_0(q, d, x, path)
    assert y.shape == (9, n) and y.dtype == torch.float32
    inputs = _fixed_point(x)
    # each block is summed exactly; the sum rounds once to fp32 and each accumulation rounds once
    bound = (k // 32 + 3) * 2.0**-23 * (inputs.abs() @ weight.abs().T) + 1e-30
    assert ((y.double() - inputs @ weight.T).abs() <= bound).all()
    # and the grid itself: 2^-15 of each block's largest |x| at worst
    grid = (x.double() - inputs).abs().max(dim=1).values / x.double().abs().max(dim=1).values
    assert (grid <= 2.0**-15).all()


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_every_row_count_gives_the_bits_of_a_one_row_call(path):
    generator = torch.Generator().manual_seed(1)
    q, d = q8_0.quantize(torch.randn(200, 96, generator=generator))  # 13 strips: every column-tile tail
    x = torch.randn(64, 96, generator=generator) * torch.logspace(-3, 3, 64)[:, None]
    alone = torch.stack([kernels.linear_q8_0(q, d, x[i : i + 1], path)[0] for i in range(64)])
    for rows in range(1, 65):
        start = (rows * 7) % (65 - rows)  # rows taken at different offsets
        assert torch.equal(kernels.linear_q8_0(q, d, x[start : start + rows], path), alone[start : start + rows]), rows


def test_every_path_gives_the_same_bits():
    """Exact integer block sums and one fp32 epilogue: scalar, avx2, vpdpbusd and AMX-INT8 (from 16 rows)
    agree to the bit, so q8_0 answers do not depend on the CPU."""
    generator = torch.Generator().manual_seed(2)
    q, d = q8_0.quantize(torch.randn(50, 100, generator=generator))
    x = torch.randn(20, 100, generator=generator) * torch.logspace(-3, 3, 20)[:, None]
    scalar = kernels.linear_q8_0(q, d, x, "scalar")
    for path in KERNEL_PATHS:
        assert torch.equal(kernels.linear_q8_0(q, d, x, path), scalar), path
        assert torch.equal(kernels.linear_q8_0(q, d, x[:3], path), scalar[:3]), path


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_a_non_finite_activation_gives_nan_not_garbage(path):
    q, d = q8_0.quantize(torch.randn(16, 64))
    x = torch.randn(2, 64)
    x[0, 3] = float("nan")
    y = kernels.linear_q8_0(q, d, x, path)
    assert y[0].isnan().all() and y[1].isfinite().all()
