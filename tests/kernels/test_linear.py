"""The linear kernel on every path this CPU runs: accuracy against float64 and batch invariance."""

from __future__ import annotations

import pytest
import torch

from specstand import kernels
from tests.conftest import KERNEL_PATHS

pytestmark = pytest.mark.skipif(not KERNEL_PATHS, reason="the kernels do not build on this machine")

# (n, k): model-like, ragged (n not a multiple of 16, odd k), one input column
SHAPES = [(96, 64), (37, 31), (130, 1)]


def _reference(weight: torch.Tensor, x: torch.Tensor, path: str) -> torch.Tensor:
    # avx512bf16 and amx round activations to bf16 (their instructions take bf16 operands); the others keep fp32
    inputs = x.bfloat16() if path in ("avx512bf16", "amx") else x
    return inputs.double() @ weight.double().T


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("shape", SHAPES)
def test_linear_matches_a_float64_reference(path, shape):
    n, k = shape
    generator = torch.Generator().manual_seed(n * 1000 + k)
    weight = torch.randn(n, k, generator=generator).bfloat16()
    x = torch.randn(9, k, generator=generator)
    y = kernels.linear(weight, x, path)
    assert y.shape == (9, n) and y.dtype == torch.float32
    # fp32 accumulation of k products: each step rounds by at most 2^-24 of the running magnitude
    bound = k * 2.0**-23 * (x.abs().double() @ weight.abs().double().T) + 1e-30
    assert ((y.double() - _reference(weight, x, path)).abs() <= bound).all()


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_every_row_count_gives_the_bits_of_a_one_row_call(path):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(200, 96, generator=generator).bfloat16()  # 13 strips: every column-tile tail
    x = torch.randn(64, 96, generator=generator) * torch.logspace(-3, 3, 64)[:, None]
    alone = torch.stack([kernels.linear(weight, x[i : i + 1], path)[0] for i in range(64)])
    for rows in range(1, 65):
        start = (rows * 7) % (65 - rows)  # rows taken at different offsets
        assert torch.equal(kernels.linear(weight, x[start : start + rows], path), alone[start : start + rows]), rows


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_prompt_sized_calls_of_a_wide_input_give_each_row_its_one_row_bits(path):
    """k = 8190 (8192 padded): the amx path takes rows in chunks of 4 blocks of 16 (their activations stay in
    L2), so 140 rows are chunks of 4, 4 and 1 block, the last an odd block with 4 padding rows, and k's last
    tile is ragged. Every row must still be the bits of its own 1-row call, and near float64."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(40, 8190, generator=generator).bfloat16()  # 3 strips: a pair and an odd one
    x = torch.randn(140, 8190, generator=generator)
    many = kernels.linear(weight, x, path)
    alone = torch.cat([kernels.linear(weight, x[i : i + 1], path) for i in range(140)])
    assert torch.equal(many, alone)
    bound = 8190 * 2.0**-23 * (x.abs().double() @ weight.abs().double().T)
    assert ((many.double() - _reference(weight, x, path)).abs() <= bound).all()


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_verify_sized_calls_of_a_long_input_give_each_row_its_one_row_bits(path):
    """k = 1999 (1000 pairs): from 12 rows the avx512bf16 path streams the next group of 4 strips into L2 during
    every sweep (a group is 250 KB here, just inside its bound); 13 strips make groups of 4, 4, 4 and 1, so a
    thread's last full group streams toward a ragged one. Each row must keep its 1-row bits, and near float64."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 1999, generator=generator).bfloat16()
    x = torch.randn(64, 1999, generator=generator) * torch.logspace(-2, 2, 64)[:, None]
    alone = torch.cat([kernels.linear(weight, x[i : i + 1], path) for i in range(64)])
    for rows in (12, 13, 17, 31, 64):
        assert torch.equal(kernels.linear(weight, x[:rows], path), alone[:rows]), rows
    bound = 1999 * 2.0**-23 * (x.abs().double() @ weight.abs().double().T)
    assert ((alone.double() - _reference(weight, x, path)).abs() <= bound).all()


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_peak_rate_is_measured(path):
    assert kernels.peak_macs_per_second(path, 200_000) > 0


def test_a_forced_path_this_cpu_lacks_is_refused(monkeypatch):
    monkeypatch.setenv(kernels.PATH_ENV, "nonsense")
    with pytest.raises(kernels.KernelPathError, match="not one of"):
        kernels.chosen_path()  # an error, not the Python forward in its place
    lacking = [path for path in kernels.PATHS if path not in kernels.available_paths()]
    if lacking:  # every path this CPU does not run
        monkeypatch.setenv(kernels.PATH_ENV, lacking[-1])
        with pytest.raises(kernels.KernelPathError, match="this CPU cannot run that path"):
            kernels.chosen_path()
    monkeypatch.setenv(kernels.PATH_ENV, "python")
    with pytest.raises(kernels.KernelsUnavailable, match="Python forward"):
        kernels.best_path()
