"""One linear, side by side: the compiled kernels (bf16 and q8_0) against torch's bf16 and fp32 F.linear on
Qwen2.5-Coder-0.5B's fused gate/up shape, by row count, with the register-loop peaks the rooflines use.

    python benchmarks/linear_vs_torch.py --out benchmarks/results/kernels/linear_vs_torch.txt
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from printed import Printed

from specstand import kernels
from specstand.kernels import q8_0

ROWS = (1, 8, 64, 512)


def median_seconds(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    say = Printed()

    path = kernels.best_path()
    n, k = 2 * 4864, 896
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).bfloat16()
    weight_fp32 = weight.float()  # torch's fp32 linear: what trained drafters ran on before the kernels
    module = kernels.load()
    ours_bf16 = module.Linear(weight, kernels.PATHS[path])
    ours_q8 = module.Linear(*q8_0.quantize(weight), kernels.PATHS[path])
    say(f"# one linear [{n} x {k}] (Qwen2.5-Coder-0.5B gate/up), {args.threads} threads, medians of {args.repeats}")
    say(f"cpu: {kernels.cpu_model()}; flags: {' '.join(kernels.cpu_flags())}; kernel path: {path}")
    peak = kernels.peak_macs_per_second(path) * args.threads
    say(f"register-loop peak: {peak / 1e9:.0f} GMAC/s bf16 ({path}); q8_0 "
        f"{kernels.peak_macs_per_second_q8_0(path) * args.threads / 1e9:.0f} (few rows), "
        f"{kernels.peak_macs_per_second_q8_0(path, True) * args.threads / 1e9:.0f} (from 16 rows)")
    say()
    say("rows | ours bf16 ms (GMAC/s) | torch bf16 ms (GMAC/s) | ours q8_0 ms (GMAC/s) | torch fp32 ms (GMAC/s)")
    for rows in ROWS:
        x = torch.randn(rows, k)
        xb = x.bfloat16()
        cells = []
        for run, inputs in ((ours_bf16.forward, x), (lambda v: torch.nn.functional.linear(v, weight), xb),
                            (ours_q8.forward, x), (lambda v: torch.nn.functional.linear(v, weight_fp32), x)):
            seconds = median_seconds(lambda run=run, inputs=inputs: run(inputs), args.repeats)
            cells.append(f"{seconds * 1e3:.2f} ({rows * n * k / seconds / 1e9:.0f})")
        say(f"{rows:4d} | {cells[0]:>21} | {cells[1]:>22} | {cells[2]:>21} | {cells[3]:>22}")
    say.write(args.out)


if __name__ == "__main__":
    main()
