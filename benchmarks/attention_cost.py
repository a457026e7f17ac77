"""What the decode/verify attention kernel costs, per path, against the path's own multiply-accumulate peak.

Attention over a long cache is most of a pass's arithmetic past a few thousand positions on a 135M model: a row
at position L does heads x head_dim x 2 x L multiply-adds (scores and weighted values), SmolLM2's linears
about 135M a row. The cases are the passes an agent's calls make: one row (decoding), 6 rows of one request
(a K=5 verify), 4 requests x 6 rows, and a 512-row prompt chunk ending at the context. The scalar path's
attention is the portable 8-lane code (GCC vectors, one key at a time, compiled for AVX2 where the CPU has it),
so `--paths scalar,avx2` sets the portable loop and the avx2 kernel side by side in one run.

    SPECSTAND_KERNEL_PATH=avx2 python benchmarks/attention_cost.py --paths scalar,avx2 --context 2048
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
from printed import Printed

from specstand import kernels

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen2.5-coder-0.5b": (14, 2, 64)}  # heads, kv heads, head_dim


def cases(context: int) -> dict[str, tuple[list[int], list[int]]]:
    """Case name -> (slots, positions) of its rows."""
    last, chunk = context - 1, min(512, context)
    return {
        "1 row": ([0], [last]),
        "6 rows (verify)": ([0] * 6, list(range(last - 5, last + 1))),
        "4 x 6 rows": ([s for s in range(4) for _ in range(6)], list(range(last - 5, last + 1)) * 4),
        f"{chunk}-row prompt chunk": ([0] * chunk, list(range(context - chunk, context))),
    }


def seconds(path: str, q, keys, values, slots, positions, scale: float, repeats: int) -> float:
    kernels.attention(q, keys, values, slots, positions, scale, path)  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        kernels.attention(q, keys, values, slots, positions, scale, path)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", default="scalar,avx2", help="kernel paths, side by side")
    parser.add_argument("--context", type=int, default=2048, help="cache length the rows end at")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    paths = args.paths.split(",")
    say = Printed()
    say(f"# attention kernel cost, one layer, context {args.context}, {args.threads} threads, "
        f"median of {args.repeats}")
    say(f"cpu: {kernels.cpu_model()}; flags: {' '.join(kernels.cpu_flags())}; best path: {kernels.best_path()}")
    peak = kernels.peak_macs_per_second("avx2") * args.threads if "avx2" in kernels.available_paths() else None
    if peak:
        say(f"avx2 fp32 FMA peak (register loop, {args.threads} threads): {peak / 1e9:.0f} GMAC/s")
    say()
    say("model | case | " + " | ".join(f"{p} ms" for p in paths) + " | " + " | ".join(f"{p} % peak" for p in paths)
        + f" | x {paths[0]}")
    for model, (heads, kv_heads, dim) in SHAPES.items():
        generator = torch.Generator().manual_seed(0)
        shape = (4, kv_heads, args.context, dim)
        keys = torch.randn(shape, generator=generator).bfloat16()
        values = torch.randn(shape, generator=generator).bfloat16()
        for name, (slots, positions) in cases(args.context).items():
            q = torch.randn(len(slots), heads * dim, generator=generator)
            s, p = torch.tensor(slots), torch.tensor(positions)
            macs = sum(heads * dim * 2 * (position + 1) for position in positions)
            took = {path: seconds(path, q, keys, values, s, p, 1 / math.sqrt(dim), args.repeats) for path in paths}
            rates = [f"{100 * macs / took[path] / peak:.0f}%" if peak else "-" for path in paths]
            say(f"{model} | {name} | " + " | ".join(f"{1e3 * took[path]:.2f}" for path in paths) + " | "
                + " | ".join(rates) + f" | x{took[paths[0]] / took[paths[-1]]:.2f}")
    say.write(args.out)


if __name__ == "__main__":
    main()
