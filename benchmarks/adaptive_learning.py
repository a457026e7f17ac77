"""How adaptive verification learns over a server's life, in one process: the workload's calls answered run
after run by one engine (its estimates kept, as a server in service keeps them; the drafter's memory forgotten
between runs, as the bench's per-run reset does), or by a fresh engine each run (`--fresh`: a server's first
run, every time). Prints each run's share of passes that verified a draft and tau over all passes; the answers
are the same either way (greedy), so only the drafting differs.

    python benchmarks/adaptive_learning.py --workload out/demo/workload.jsonl --method suffix --runs 4 [--fresh]

`--batch 4` answers the calls four at a time (one engine step for all four), as a rough stand-in for 4 users.
"""

from __future__ import annotations

import argparse

from specstand import kernels
from specstand.drafters import make_drafter
from specstand.engine import Engine, EngineConfig, Request
from specstand.models import load_model
from specstand.verification import SamplingParams
from specstand.workloads import load_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="q8_0")
    parser.add_argument("--method", default="suffix")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--fresh", action="store_true", help="a new engine (and drafter) for every run")
    args = parser.parse_args()
    machine = kernels.machine()
    print(f"cpu: {machine.get('cpu')}; flags: {' '.join(machine.get('flags', []))}; "
          f"kernel path: {machine.get('kernel_path')}")
    model = load_model(args.model, args.dtype, 4096, log=lambda *_: None)
    calls = [c for turn in load_workload(args.workload) for c in turn.calls if c.messages is not None]
    prompts = [model.encode_messages(c.messages, c.tools) for c in calls]

    def new_engine() -> Engine:
        drafter = make_drafter(args.method, model.decoder, args.model, None, None, model.tokenizer)
        return Engine(model.decoder, drafter, EngineConfig(5, 4096, max_batch=args.batch))

    engine = new_engine()
    for run in range(args.runs):
        engine = new_engine() if args.fresh and run > 0 else engine
        engine.forget_history()
        passes = drafted = emitted = 0
        for start in range(0, len(calls), args.batch):
            requests = [Request(p, c.max_tokens, SamplingParams(), model.stop_token_ids)
                        for p, c in zip(prompts[start:start + args.batch], calls[start:start + args.batch],
                                        strict=True)]
            for result in engine.generate(requests):
                passes += result.stats.target_passes
                drafted += result.stats.passes_with_draft
                emitted += len(result.output_ids)
        print(f"run {run + 1}: {drafted / passes:.0%} of passes verified a draft, tau {emitted / passes:.2f} "
              f"({passes} passes)", flush=True)


if __name__ == "__main__":
    main()
