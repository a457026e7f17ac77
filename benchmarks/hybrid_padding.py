"""What a hybrid target's gated delta rule costs for a pass's real rows only, against all of its rows.

In exact mode every plain decoding step is a pass of K + 1 rows, one of them real, and a prompt's last block is
padded to the block: the Python delta rule (Qwen3.5, Qwen3-Next) runs token by token, so each padding row it
computes costs as much as a real one. It now stops at the real rows (`GatedDeltaNet._delta_rule`); running it
with real = width is what every pass cost before. One layer's state is [value heads, dk, dv] in fp32; the default
is 16 heads of 128 x 128 (Qwen3-Next's head size).

    python benchmarks/hybrid_padding.py --rows 6 --heads 16 --dim 128 --repeats 30
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from printed import Printed

from specstand import kernels
from specstand.runner.mixers import GatedDeltaNet


def delta_rule(heads: int, dim: int) -> GatedDeltaNet:
    """A layer with only what `_delta_rule` reads: the head counts and sizes."""
    layer = GatedDeltaNet.__new__(GatedDeltaNet)
    layer.num_k_heads = layer.num_v_heads = heads
    layer.head_k_dim = layer.head_v_dim = dim
    return layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=6, help="rows of the pass (K + 1)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128, help="dk = dv")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layer, rows, heads, dim = delta_rule(args.heads, args.dim), args.rows, args.heads, args.dim
    qkv = torch.randn(rows, 3 * heads * dim)
    beta, decay, state = torch.rand(rows, heads), -torch.rand(rows, heads), torch.randn(heads, dim, dim)
    times: dict[int, list[float]] = {1: [], rows: []}
    with torch.inference_mode():
        for _ in range(args.repeats):  # alternating, so drift hits both alike
            for real in times:
                started = time.perf_counter()
                layer._delta_rule(qkv, beta, decay, state, real)
                times[real].append(time.perf_counter() - started)
    say = Printed()
    machine = kernels.machine()
    say(f"cpu: {machine['cpu']}; flags: {' '.join(machine['flags']) or 'none'}; {args.threads} threads")
    say(f"delta rule, one layer, state {heads} x {dim} x {dim} fp32, a pass of {rows} rows, {args.repeats} calls each")
    one, every = statistics.median(times[1]), statistics.median(times[rows])
    say(f"1 real row, padding skipped: {one * 1e3:.2f} ms; all {rows} rows (before): {every * 1e3:.2f} ms; "
        f"x{every / one:.2f}")
    say.write(args.out)


if __name__ == "__main__":
    main()
