"""Q8_0 weights, as GGUF stores them: per output row, each block of 32 consecutive inputs shares an fp16
scale d, and every weight is d * q with q an int8 in [-127, 127]. The compiled linears read these blocks as
they are (about half the bytes of bf16); `dequantize` gives the same values as fp32 (exact: an fp16 times
an int8 fits in a float's 24 bits)."""

from __future__ import annotations

import torch

BLOCK = 32


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [n, k], d fp16 [n, ceil(k / 32)]) of a weight [n, k]: d = max |w| / 127 over the block (rounded
    to fp16, as GGUF stores it), q = round(w / d) against that rounded d. A last partial block is padded
    with zeros."""
    n, k = weight.shape
    blocks = -(-k // BLOCK)
    w = torch.zeros(n, blocks * BLOCK, dtype=torch.float32)
    w[:, :k] = weight.float()
    w = w.view(n, blocks, BLOCK)
    d = (w.abs().amax(dim=2) / 127).half()
    safe = torch.where(d == 0, torch.ones_like(d), d).float()
    q = torch.round(w / safe[:, :, None]).clamp(-127, 127).to(torch.int8)
    return q.view(n, blocks * BLOCK)[:, :k].contiguous(), d


def dequantize(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [n, k] that Q8_0 blocks (q, d) stand for."""
    n, k = q.shape
    scale = d.float().repeat_interleave(BLOCK, dim=1)[:, :k]
    return q.float() * scale
