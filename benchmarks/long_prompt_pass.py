"""A preset's compiled passes at the length agent prompts reach: prompt tokens/s over a whole long prompt, then one
decode row and one 6-row verify at its end (median of repeats, wall time). For A/B runs of two trees, alternate
processes with PYTHONPATH at each (the kernels are built per source version).

    SPECSTAND_KERNEL_PATH=avx2 python benchmarks/long_prompt_pass.py --model smollm2-135m --dtype q8_0 --length 2000
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from pass_cost import prompt_tokens_per_second

from specstand import kernels
from specstand.models import load_model
from specstand.runner import PassInput, TargetRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="q8_0")
    parser.add_argument("--length", type=int, default=2000, help="prompt tokens")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, args.dtype, args.length + 64, log=lambda _: None)
    runner = TargetRunner(loaded.decoder, 1, args.length + 64)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(10, 1000, (args.length,), generator=generator).tolist()
    slot = runner.cache.allocate()
    prompt_rate = prompt_tokens_per_second(runner, slot, prompt)
    passes: dict[int, list[float]] = {1: [], 6: []}
    for _ in range(7):
        for rows in passes:
            runner.cache.rollback(slot, args.length)
            started = time.perf_counter()
            runner.run([PassInput(slot, prompt[:rows])], rows)
            passes[rows].append(time.perf_counter() - started)
    print(f"{kernels.cpu_model()}; flags {' '.join(kernels.cpu_flags())}; path {kernels.best_path()}; "
          f"{args.model} {args.dtype}, {args.threads} threads, {args.length}-token prompt: "
          f"{prompt_rate:.0f} prompt tokens/s, "
          f"1 row {1e3 * statistics.median(passes[1]):.1f} ms, 6 rows {1e3 * statistics.median(passes[6]):.1f} ms")


if __name__ == "__main__":
    main()
