"""Start-up check of how pass shapes affect rounding on this machine, dtype and model.

Greedy speculative decoding is only token-identical to plain decoding if a row's logits do not depend on
how many rows share its pass. Whether a kernel keeps rows independent depends on the BLAS path chosen for
each matrix shape (fp32 ones differ for small odd counts on the CPUs seen). Shapes, not values, select
kernels, so running the real model over random tokens in every pass size we will use finds every fp32
difference. It cannot vouch for bf16 outputs: their rounding hides a changed fp32 accumulation order
almost always, so the Python forward computes bf16 rows of a decode/verify pass one at a time
(transformer.linear) and the compiled kernels are row-invariant by construction.
"""

from __future__ import annotations

import torch

from specstand.runner.runner import PassInput, TargetRunner


def row_unit(runner: TargetRunner, width: int, batch_sizes: tuple[int, ...] = (1, 2)) -> int:
    """How many rows every request's pass must be padded to (a multiple of) for a row's logits not to
    depend on the pass: 1 if passes of any size 1..width agree with one row at a time; else the first
    fixed padded size that agrees (BLAS kernels often block rows by 4 or 8); 0 if none does."""
    candidates = [1] + sorted({width, *(-(-width // block) * block for block in (4, 8, 16))})
    for unit in candidates:
        if _shapes_agree(runner, width, unit, batch_sizes):
            return unit
    return 0


def _shapes_agree(runner: TargetRunner, width: int, unit: int, batch_sizes: tuple[int, ...]) -> bool:
    generator = torch.Generator().manual_seed(0)
    vocab = runner.model.shape.vocab_size
    prefix_len = 3
    chunks = list(range(width, 0, -1))  # every block size at a different offset
    tail_len = sum(chunks)
    for batch in batch_sizes:
        if prefix_len + tail_len + max(width, unit) > runner.capacity:
            raise ValueError(f"cache capacity {runner.capacity} is too small to check pass shapes")
        if batch > runner.cache.free_slots:
            continue
        seqs = [torch.randint(vocab, (prefix_len + tail_len,), generator=generator).tolist() for _ in range(batch)]
        reference = _decode(runner, seqs, prefix_len, [1] * tail_len, unit)
        if not torch.equal(reference, _decode(runner, seqs, prefix_len, chunks, unit)):
            return False
    return True


def _decode(runner: TargetRunner, seqs: list[list[int]], prefix_len: int, chunks: list[int], unit: int) -> torch.Tensor:
    slots = [runner.cache.allocate() for _ in seqs]
    try:
        for slot, seq in zip(slots, seqs, strict=True):
            runner.prefill(slot, seq[:prefix_len])
        outputs, pos = [], prefix_len
        for k in chunks:
            width = -(-k // unit) * unit
            inputs = [PassInput(slot, seq[pos : pos + k]) for slot, seq in zip(slots, seqs, strict=True)]
            passes = runner.run(inputs, width)
            outputs.append(torch.stack([p.logits for p in passes]))
            pos += k
        return torch.cat(outputs, dim=1)
    finally:
        for slot in slots:
            runner.cache.release(slot)
