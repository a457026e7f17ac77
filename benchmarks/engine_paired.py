"""Methods side by side in one process: one target, one engine per method, every batch of U calls run on
each engine in turn (order reversed every round), so bandwidth drift hits all methods alike. The engine
alone: no server, no HTTP, each batch started together (the stand, `specstand bench`, replays turns with
their arrival times). Prints each method's total seconds per round and its speedup over the first method.

    python benchmarks/engine_paired.py --workload heldout.jsonl --model qwen2.5-coder-0.5b --dtype q8_0 \\
        --users 4 --methods none,eagle3@fixed,eagle3 --calls 12 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from printed import Printed

from specstand import kernels
from specstand.drafters import default_k, make_drafter
from specstand.engine import Engine, EngineConfig, Request
from specstand.models import load_model
from specstand.training.data import prompt_ids
from specstand.verification import SamplingParams
from specstand.workloads import load_workload

PHASES = ("prompt", "decode", "draft", "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--users", type=int, default=4, help="calls decoded together (one batch)")
    parser.add_argument("--methods", default="none,eagle3@fixed,eagle3",
                        help="the first is the baseline; METHOD@fixed: every draft verified at fixed K")
    parser.add_argument("--calls", type=int, default=12, help="the workload's first calls, in order")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    say = Printed()

    model = load_model(args.model, args.dtype, 4096, log=lambda _: None)
    calls = [call for turn in load_workload(args.workload) for call in turn.calls][: args.calls]
    requests = [Request(prompt_ids(model, call), call.max_tokens, SamplingParams(), model.stop_token_ids)
                for call in calls]
    context = max(len(r.prompt_ids) + r.max_tokens for r in requests) + 16
    engines: dict[str, Engine] = {}
    for method in args.methods.split(","):
        name, _, flag = method.partition("@")
        drafter = make_drafter(name, model.decoder, args.model, tokenizer=model.tokenizer)
        config = EngineConfig(default_k(drafter, None), context, args.users, adaptive=flag != "fixed")
        engines[method] = Engine(model.decoder, drafter, config)
    bandwidth = [kernels.read_bandwidth_gbs()]
    say(f"# {args.model} {args.dtype}, {len(requests)} calls of {args.workload.name} in batches of {args.users}, "
        f"{args.rounds} rounds, {args.threads} threads")
    say(f"cpu: {kernels.cpu_model()}; flags: {' '.join(kernels.cpu_flags())}; kernel path: {kernels.best_path()}")
    for engine in engines.values():  # warm-up
        engine.generate(requests[:1])
    seconds: dict[str, list[float]] = defaultdict(list)
    tokens: dict[str, int] = defaultdict(int)
    passes: dict[str, int] = defaultdict(int)
    drafted: dict[str, int] = defaultdict(int)  # passes that verified a draft (adaptive verification's probes too)
    runs: dict[str, int] = defaultdict(int)  # steps the drafter ran for a call
    probes: dict[str, int] = defaultdict(int)  # of those, steps that did not pay
    phases: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(PHASES, 0.0))
    answers: dict[str, list[list[int]]] = defaultdict(list)
    for round_ in range(args.rounds):
        order = list(engines) if round_ % 2 == 0 else list(engines)[::-1]
        totals = dict.fromkeys(engines, 0.0)
        for first in range(0, len(requests), args.users):
            for method in order:
                engine = engines[method]
                engine.reset()  # every batch starts without cached prompts, on every engine
                before = {phase: getattr(engine.times, phase) for phase in PHASES}
                started = time.perf_counter()
                results = engine.generate(requests[first : first + args.users])
                totals[method] += time.perf_counter() - started
                for phase in PHASES:
                    phases[method][phase] += getattr(engine.times, phase) - before[phase]
                runs[method] += sum(r.stats.drafter_runs for r in results)
                probes[method] += sum(r.stats.probes for r in results)
                tokens[method] += sum(len(r.output_ids) for r in results)
                passes[method] += sum(r.stats.target_passes for r in results)
                drafted[method] += sum(r.stats.passes_with_draft for r in results)
                if round_ == 0:
                    answers[method] += [r.output_ids for r in results]
        for method, total in totals.items():
            seconds[method].append(total)
        bandwidth.append(kernels.read_bandwidth_gbs())
    say(f"read bandwidth: {min(bandwidth):.1f}-{max(bandwidth):.1f} GB/s")
    say()
    base = next(iter(engines))
    say(f"method | seconds per round | speedup over {base} per round (median) | tau | drafted passes | "
        "answers identical")
    for method in engines:
        ratios = [b / s for b, s in zip(seconds[base], seconds[method], strict=True)]
        same = sum(a == b for a, b in zip(answers[method], answers[base], strict=True)) / len(answers[base])
        say(f"{method} | {' '.join(f'{s:.2f}' for s in seconds[method])} | "
            f"{' '.join(f'x{r:.3f}' for r in ratios)} (x{statistics.median(ratios):.3f}) | "
            f"{tokens[method] / passes[method]:.2f} | {drafted[method] / passes[method]:.0%} | {same:.0%}")
    say()
    say("where each method's time went, seconds per round (engine counters): prompt passes, decode/verify "
        "passes, drafting, other; drafter runs and probes that did not pay, per pass")
    say("method | prompt | decode | draft | other | drafter runs | probes")
    for method in engines:
        cells = " | ".join(f"{phases[method][phase] / args.rounds:.2f}" for phase in PHASES)
        say(f"{method} | {cells} | {runs[method] / passes[method]:.0%} | {probes[method] / passes[method]:.0%}")
    say.write(args.out)


if __name__ == "__main__":
    main()
