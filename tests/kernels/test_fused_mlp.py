"""The amx linear with the MLP's activation fused in: the bits of the unfused linear, silu_mul and rounding."""

from __future__ import annotations

import pytest
import torch

from specstand import kernels
from tests.conftest import KERNEL_PATHS

pytestmark = pytest.mark.skipif("amx" not in KERNEL_PATHS, reason="this CPU has no AMX")


def _gate_up(intermediate: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Generator]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2 * intermediate, hidden, generator=generator).bfloat16(), generator


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 100, 300])
def test_fused_activation_has_the_bits_of_linear_then_silu_mul(rows):
    """Every row count the amx kernel cuts differently: one block, pairs of blocks, an odd last block, padding rows,
    several row chunks (k = 2080: chunks of 14 blocks), inputs spanning 12 orders of magnitude."""
    weight, generator = _gate_up(96, 2080, rows)
    linear = kernels.pack(weight, "amx")
    x = torch.randn(rows, 2080, generator=generator) * torch.logspace(-6, 6, rows)[:, None]
    fused, unfused = linear.silu_mul_tiles(x, True), linear.silu_mul_tiles(x, False)
    assert torch.equal(fused.view(torch.int16), unfused.view(torch.int16))
    assert fused.float().abs().sum() > 0  # not two empty buffers


def test_fused_activation_is_silu_of_gate_times_up():
    """The tile layout read back: row r, column c of the activation is silu(x Wg^T) * (x Wu^T) within bf16."""
    intermediate, hidden, rows = 64, 96, 20
    weight, generator = _gate_up(intermediate, hidden, 7)
    x = torch.randn(rows, hidden, generator=generator)
    tiles = kernels.pack(weight, "amx").silu_mul_tiles(x, True).float()
    # [blocks][intermediate / 32][16 rows][32 columns] -> [rows][intermediate]
    act = tiles.view(-1, intermediate // 32, 16, 32).permute(0, 2, 1, 3).reshape(-1, intermediate)
    gate_up = x.bfloat16().double() @ weight.double().T
    expected = torch.nn.functional.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    assert torch.allclose(act[:rows].double(), expected, rtol=2**-7, atol=1e-4)
    assert torch.equal(act[rows:], torch.zeros_like(act[rows:]))  # padding rows of the last block


def test_a_gate_up_width_the_fused_kernel_does_not_take_is_refused():
    weight, generator = _gate_up(40, 64, 3)  # 2I = 80: not a multiple of 64
    with pytest.raises(RuntimeError, match="linear_silu_mul"):
        kernels.pack(weight, "amx").silu_mul_tiles(torch.randn(3, 64, generator=generator), True)
