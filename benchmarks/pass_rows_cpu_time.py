"""What one compiled target pass costs by row count, on one thread, in that thread's CPU time, against the kernel
path's peak measured the same way: a kernel-efficiency figure that a busy host (neighbours taking turns on the
cores, helpers running tests) barely moves, where wall-time figures (pass_cost.py) need a quiet machine.

Prints per row count: ms of a pass (rows spread over requests of up to 8 rows, each attending over --context cached
positions), x one row, the share of the path's peak multiply-accumulate rate its linears' MACs would take, and
prompt tokens/s; with the CPU flags and the kernel path.

    SPECSTAND_KERNEL_PATH=avx2 python benchmarks/pass_rows_cpu_time.py --model qwen2.5-coder-0.5b --dtype q8_0
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from pass_cost import PROMPT, pass_inputs, peak_rates, weight_bytes_and_macs
from printed import Printed

from specstand import kernels
from specstand.models import load_model
from specstand.runner import TargetRunner

ROWS = (1, 2, 4, 8, 16, 32, 64)


def cpu_seconds(run, repeats: int) -> float:
    """The least CPU time of `repeats` calls of run() on this thread (a neighbour's turn only ever adds time)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.thread_time()
        run()
        best = min(best, time.thread_time() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "q8_0"])
    parser.add_argument("--context", type=int, default=256, help="cached positions each row attends over")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the kernels run on this thread, which thread_time() clocks
    say = Printed()
    loaded = load_model(args.model, args.dtype, max_seq_len=1024, log=lambda _: None)
    if loaded.decoder.compiled is None:
        raise SystemExit("the compiled forward does not run here")
    path = loaded.decoder.compiled.path
    runner = TargetRunner(loaded.decoder, 8, 1024)
    slots = [runner.cache.allocate() for _ in range(8)]
    for slot in slots:
        runner.prefill(slot, list(range(100, 100 + args.context)))
    _, macs = weight_bytes_and_macs(runner, args.dtype)
    peaks = peak_rates(path, args.dtype, 1)
    say(f"# compiled pass by row count: {args.model} {args.dtype}, 1 thread, its CPU time (least of {args.repeats})")
    say(f"cpu: {kernels.cpu_model()}; flags: {' '.join(kernels.cpu_flags())}; kernel path: {path}")
    say(f"peak {' / '.join(f'{rate / 1e9:.1f}' for rate in dict.fromkeys(peaks.values()))} GMAC/s a core "
        f"(register loop, CPU time); linears: {macs / 1e6:.0f} M multiply-accumulates a row")
    say()
    say("rows | ms   | x one row | linears' MACs / peak")
    one_row = None
    for rows in ROWS:
        inputs, per = pass_inputs(slots, rows)

        def run(inputs=inputs, per=per) -> None:
            for slot in slots:
                runner.cache.rollback(slot, args.context)
            runner.run(inputs, per)

        run()
        seconds = cpu_seconds(run, args.repeats)
        one_row = one_row or seconds
        share = rows * macs / peaks[rows >= 16] / seconds
        say(f"{rows:4d} | {seconds * 1e3:6.1f} | {seconds / one_row:9.2f} | {share:.0%}")
    prompt_ids = loaded.encode_messages([{"role": "user", "content": " ".join([PROMPT] * 24)}])[:512]

    def prefill() -> None:
        runner.cache.rollback(slots[0], 0)
        runner.prefill(slots[0], prompt_ids)

    seconds = cpu_seconds(prefill, 2)
    say(f"prompt ({len(prompt_ids)} tokens, through the {'compiled kernels' if runner.compiled_prompts else 'torch'}): "
        f"{len(prompt_ids) / seconds:.0f} tokens/s, {len(prompt_ids) * macs / peaks[True] / seconds:.0%} of peak")
    say.write(args.out)


if __name__ == "__main__":
    main()
