"""Where a prompt's time goes against the kernel path's measured MAC peak: a preset's compiled prompt passes
(chunks of PROMPT_CHUNK rows) at agent prompt lengths, split into linears / attention / head / rest, each with the
multiply-accumulates it computed per second and its share of the peak of the instruction it runs on (the linears
and head: the dtype's kernel, so q8_0's integer loop for q8_0; attention: the path's fp32/bf16 FMA loop). The
whole prompt's share is its roofline time (each phase's MACs at its peak) over its measured time. Beside them
torch's own bf16 GEMM (oneDNN) on the same linear shapes at one chunk's rows, measured in the same run.

    python benchmarks/prompt_roofline.py --model qwen2.5-coder-0.5b --dtype q8_0 --lengths 512,2048 --out FILE

For A/B runs of two trees, alternate processes with PYTHONPATH at each (the kernels are built per source version).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from pass_cost import peak_rates
from printed import Printed

from specstand import kernels
from specstand.models import load_model
from specstand.runner import TargetRunner
from specstand.runner.runner import PROMPT_CHUNK

PHASES = ("linear", "attention", "head", "other")


def prompt_macs(shape, length: int) -> dict[str, float]:
    """Multiply-accumulates of a `length`-token prompt by phase: every layer's linears per token, causal
    attention (q.k and p.v over positions 0..p for the row at p), the head once per chunk (its last row)."""
    s = shape
    per_token = s.num_layers * (s.hidden_size * (s.q_size + 2 * s.kv_size) + s.q_size * s.hidden_size
                                + 3 * s.hidden_size * s.intermediate_size)
    attention = s.num_layers * s.num_heads * 2 * s.head_dim * length * (length + 1) / 2
    chunks = -(-length // PROMPT_CHUNK)
    return {"linear": per_token * length, "attention": attention, "head": chunks * s.hidden_size * s.vocab_size,
            "other": 0.0}


def time_prompt(runner: TargetRunner, prompt: list[int], repeats: int) -> tuple[float, dict[str, float]]:
    """Median seconds of the whole prompt and of each phase over the repeats (one warm-up). Medians, not means:
    one repeat slowed by a neighbour on the host would otherwise move every phase's figure."""
    slot = runner.cache.allocate()
    compiled = runner.compiled
    times: list[float] = []
    phases: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for repeat in range(repeats + 1):
        runner.cache.rollback(slot, 0)
        compiled.take_profile()
        started = time.perf_counter()
        runner.prefill(slot, prompt)
        if repeat:
            times.append(time.perf_counter() - started)
            profile = compiled.take_profile()
            for phase in PHASES:
                phases[phase].append(profile.get(phase, 0.0))
    runner.cache.release(slot)
    return statistics.median(times), {phase: statistics.median(seconds) for phase, seconds in phases.items()}


def torch_gemm_rate(shape, rows: int, repeats: int) -> float:
    """torch's bf16 matmul (oneDNN on these CPUs) over one layer's linear shapes at `rows` rows: MAC/s."""
    s, generator = shape, torch.Generator().manual_seed(0)
    shapes = ((s.q_size + 2 * s.kv_size, s.hidden_size), (s.hidden_size, s.q_size),
              (2 * s.intermediate_size, s.hidden_size), (s.hidden_size, s.intermediate_size))
    seconds, macs = 0.0, 0
    for n, k in shapes:
        weight = torch.randn(n, k, generator=generator).bfloat16()
        x = torch.randn(rows, k, generator=generator).bfloat16()
        out = torch.empty(rows, n, dtype=torch.bfloat16)
        torch.matmul(x, weight.t(), out=out)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            torch.matmul(x, weight.t(), out=out)
            times.append(time.perf_counter() - started)
        seconds += statistics.median(times)
        macs += rows * n * k
    return macs / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--lengths", default="512,2048", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--dtype", default="bf16", help="bf16 or q8_0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    say = Printed()
    lengths = [int(n) for n in args.lengths.split(",")]
    loaded = load_model(args.model, args.dtype, max_seq_len=max(lengths) + 64, log=lambda _: None)
    compiled = loaded.decoder.compiled
    if compiled is None or not compiled.fast_for_prompts:
        raise SystemExit("this path computes prompts with torch, not the compiled forward: nothing to measure")
    shape = loaded.decoder.shape
    peak = kernels.peak_macs_per_second(compiled.path) * args.threads  # attention's, and torch's bf16 GEMM's
    linear_peaks = peak_rates(compiled.path, args.dtype, args.threads)  # by whether a pass has 16 rows or more
    peaks = {"linear": linear_peaks[True], "attention": peak, "head": linear_peaks[False]}  # head: one row a chunk
    say(f"# prompt roofline: {args.model} {args.dtype}, {args.threads} threads, {PROMPT_CHUNK}-row chunks, "
        f"medians of {args.repeats}")
    say(f"cpu: {kernels.cpu_model()}; flags: {' '.join(kernels.cpu_flags())}; kernel path: {compiled.path}")
    say(f"peaks ({compiled.path} register loops x {args.threads} cores): linears {peaks['linear'] / 1e9:.0f} "
        f"GMAC/s ({args.dtype}), attention {peak / 1e9:.0f} GMAC/s (FMA); read bandwidth "
        f"{kernels.read_bandwidth_gbs():.1f} GB/s")
    say()
    say("tokens | tokens/s | % of roofline | "
        + " | ".join(f"{p} ms" + (" (% of peak)" if p != "other" else "") for p in PHASES))
    runner = TargetRunner(loaded.decoder, 1, max(lengths) + 64)
    generator = torch.Generator().manual_seed(1)
    for length in lengths:
        prompt = torch.randint(10, 1000, (length,), generator=generator).tolist()
        seconds, phases = time_prompt(runner, prompt, args.repeats)
        macs = prompt_macs(shape, length)
        cells = [f"{phases[p] * 1e3:.1f}" + (f" ({macs[p] / phases[p] / peaks[p]:.0%})" if macs[p] else "")
                 for p in PHASES]
        roofline = sum(macs[p] / peaks[p] for p in peaks)
        say(f"{length:6d} | {length / seconds:8.0f} | {roofline / seconds:13.0%} | "
            + " | ".join(cells))
    rate = torch_gemm_rate(shape, PROMPT_CHUNK, args.repeats)
    say()
    say(f"peer: torch {torch.__version__} bf16 matmul on one layer's four linear shapes at {PROMPT_CHUNK} rows: "
        f"{rate / 1e9:.0f} GMAC/s ({rate / peak:.0%} of peak)")
    say(f"read bandwidth after the run {kernels.read_bandwidth_gbs():.1f} GB/s")
    say.write(args.out)


if __name__ == "__main__":
    main()
