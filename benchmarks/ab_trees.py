"""A/B of two source trees on one machine: a long-lived worker process per tree (PYTHONPATH at it, so each builds
and loads its own kernels: one process cannot hold two builds), the same calls alternating between them one by one,
so host drift and neighbours weigh on both alike. Each case prints both medians, their ratio and the median of the
per-call ratios with its interquartile range (x = A / B: above 1, B is faster).

    git worktree add /tmp/base HEAD~1
    python benchmarks/ab_trees.py /tmp/base . --model smollm2-135m --dtype q8_0 --cases prompt:7,1row:41,6rows:41,4x1:41
    python benchmarks/ab_trees.py /tmp/base . --model qwen2.5-coder-0.5b --cases attn-1row:101,attn-512:11

Cases: whole passes of the preset (`prompt`: a `--length`-token prompt; `1row`, `6rows`: one request at that
position; `4x1`, `4x6`: four requests) or one layer's attention alone over a random bf16 cache of that length
(`attn-` and the same names, or `attn-512`: a 512-row prompt chunk ending there). Leave OMP_WAIT_POLICY as the
server runs it (unset): PASSIVE keeps the idle worker's threads off the cores but charges every parallel region a
wake-up, which a decode pass (hundreds of small regions) pays heavily; `--gap-ms` lets the other worker's threads
stop spinning before each call instead.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from printed import Printed

ROWS = {"1row": [1], "6rows": [6], "4x1": [1] * 4, "4x6": [6] * 4}


def worker(model_name: str, dtype: str, length: int, threads: int) -> None:
    """Answer case names from stdin with the seconds one call took."""
    import torch

    from specstand import kernels
    from specstand.models import load_model
    from specstand.runner import PassInput, TargetRunner

    torch.set_num_threads(threads)
    loaded = load_model(model_name, dtype, length + 64, log=lambda _: None)
    shape = loaded.decoder.shape
    path = loaded.decoder.compiled.path if loaded.decoder.compiled is not None else kernels.chosen_path()[0]
    runner = TargetRunner(loaded.decoder, 4, length + 64)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(10, 1000, (length,), generator=generator).tolist()
    slots = [runner.cache.allocate() for _ in range(4)]
    for slot in slots:
        runner.prefill(slot, prompt)
    cache_shape = (4, shape.num_kv_heads, length, shape.head_dim)
    keys = torch.randn(cache_shape, generator=generator).bfloat16()
    values = torch.randn(cache_shape, generator=generator).bfloat16()

    def attention_case(name: str):
        rows = [512] if name == "512" else ROWS[name]
        slot_ids = [s for s, n in enumerate(rows) for _ in range(n)]
        positions = [p for n in rows for p in range(length - n, length)]
        q = torch.randn(len(slot_ids), shape.num_heads * shape.head_dim, generator=generator)
        args = (q, keys, values, torch.tensor(slot_ids), torch.tensor(positions), 1 / math.sqrt(shape.head_dim))
        return lambda: kernels.attention(*args, path)

    def pass_case(name: str):
        if name == "prompt":
            def run() -> None:
                runner.cache.rollback(slots[0], 0)
                runner.prefill(slots[0], prompt)
            return run
        rows = ROWS[name]
        work = [PassInput(slots[i], prompt[:n]) for i, n in enumerate(rows)]

        def run() -> None:
            for slot in slots:
                runner.cache.rollback(slot, length)
            runner.run(work, max(rows))
        return run

    calls = {}
    for line in sys.stdin:
        name = line.strip()
        if name not in calls:
            calls[name] = attention_case(name[5:]) if name.startswith("attn-") else pass_case(name)
            calls[name]()  # warm-up: the first call of each case is not timed
        started = time.perf_counter()
        calls[name]()
        print(time.perf_counter() - started, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree_a", type=Path, help="the baseline tree (a git worktree)")
    parser.add_argument("tree_b", type=Path, help="the tree under test")
    parser.add_argument("--cases", default="prompt:7,1row:41,6rows:41,4x1:41", help="name:calls, comma-separated")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="q8_0")
    parser.add_argument("--length", type=int, default=2000, help="prompt length / cache position of the cases")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gap-ms", type=float, default=20.0, help="pause before each call")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    if any(case.split(":")[0] == "attn-512" for case in args.cases.split(",")) and args.length < 512:
        parser.error("attn-512 is a 512-row chunk ending at --length: give --length >= 512")
    from specstand import kernels

    say = Printed()
    say(f"# A/B {args.tree_a} (A) against {args.tree_b} (B): {args.model} {args.dtype}, position {args.length}, "
        f"{args.threads} threads, calls alternating; x = A / B")
    say(f"cpu: {kernels.cpu_model()}; flags: {' '.join(kernels.cpu_flags())}; kernel path: {kernels.best_path()}; "
        f"read bandwidth {kernels.read_bandwidth_gbs():.1f} GB/s")
    command = [sys.executable, __file__, "--worker", args.model, args.dtype, str(args.length), str(args.threads)]
    workers = [subprocess.Popen(command, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree.resolve())},
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for tree in (args.tree_a, args.tree_b)]
    try:
        for case in args.cases.split(","):
            name, calls = case.split(":")
            times: list[list[float]] = [[], []]
            for call in range(int(calls)):
                for i in (0, 1) if call % 2 == 0 else (1, 0):  # who goes first alternates too
                    time.sleep(args.gap_ms / 1e3)
                    workers[i].stdin.write(name + "\n")
                    workers[i].stdin.flush()
                    times[i].append(float(workers[i].stdout.readline()))
            a, b = times
            ratios = sorted(x / y for x, y in zip(a, b, strict=True))
            quarter = len(ratios) // 4
            say(f"{name}: A {1e3 * statistics.median(a):.3f} ms, B {1e3 * statistics.median(b):.3f} ms, "
                f"x{statistics.median(a) / statistics.median(b):.2f} (paired x{statistics.median(ratios):.2f}, "
                f"IQR {ratios[quarter]:.2f}-{ratios[-1 - quarter]:.2f})")
    finally:
        for process in workers:
            process.stdin.close()
            process.wait()
    say(f"read bandwidth after the run {kernels.read_bandwidth_gbs():.1f} GB/s")
    say.write(args.out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
