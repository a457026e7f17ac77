"""What suffix decoding's bookkeeping costs the engine thread per call: one user's calls of a workload in order,
each begun (its prompt indexed), extended by an answer one token at a time and ended, with the prompt trees of
ended calls kept (the default) and not kept (`max_cached_prompts=0`), side by side in one run. CPU time, the
least of the repeats; no target model runs, only its tokenizer and chat template (the prompts the engine sees).
`--against REV` measures suffix.py of a git revision too, the two taking turns (rounds), and prints the ratios,
proposals included (before each token of the answers the workload recorded; the drafts compared).

    python benchmarks/drafter_bookkeeping.py --workload out/demo/workload.jsonl --model smollm2-135m [--against REV]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

from printed import Printed

from specstand import kernels
from specstand.drafters import SequenceView, SuffixConfig, suffix
from specstand.models.loading import encode_messages, encode_prompt, resolve_model_path
from specstand.workloads import load_workload


def bookkeeping_seconds(prompts: list[list[int]], answer_tokens: int, config: SuffixConfig, repeats: int,
                        module: ModuleType = suffix) -> float:
    """Least CPU seconds of begin + extend (one token at a time) + end over every prompt, in order."""
    answer = list(range(100, 100 + answer_tokens))
    best = float("inf")
    for _ in range(repeats):
        drafter = module.SuffixDrafter(module.SuffixConfig(**vars(config)))
        started = time.process_time()
        for i, prompt in enumerate(prompts):
            seq = SequenceView(i, list(prompt), len(prompt))
            drafter.begin(seq)
            for token in answer:
                seq.token_ids.append(token)
                drafter.extend(seq, [token])
            drafter.end(seq)
        best = min(best, time.process_time() - started)
    return best


def propose_seconds(prompts: list[list[int]], answers: list[list[int]], k: int, repeats: int,
                    module: ModuleType = suffix) -> tuple[float, list[list[int]]]:
    """Least CPU seconds of the proposals (one before every answer token, K tokens asked) over every call in
    order, and the drafts they gave (each call begun, its answer appended after each proposal, then ended)."""
    best, drafts = float("inf"), []
    for _ in range(repeats):
        drafter = module.SuffixDrafter()
        drafts, spent = [], 0.0
        for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
            seq = SequenceView(i, list(prompt), len(prompt))
            drafter.begin(seq)
            for token in answer:
                started = time.process_time()
                drafts.append(drafter.propose(seq, k).tokens)
                spent += time.process_time() - started
                seq.token_ids.append(token)
                drafter.extend(seq, [token])
            drafter.end(seq)
        best = min(best, spent)
    return best, drafts


def module_at(revision: str) -> ModuleType:
    """specstand/drafters/suffix.py as it was at a git revision, imported beside today's."""
    source = subprocess.run(["git", "show", f"{revision}:specstand/drafters/suffix.py"], check=True,
                            capture_output=True, text=True).stdout
    name = f"suffix_at_{revision}"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, f"{revision}:suffix.py", "exec"), module.__dict__)
    return module


def against(say: Printed, prompts: list[list[int]], answers: list[list[int]], args: argparse.Namespace) -> None:
    """Today's suffix.py and a revision's, taking turns; medians over the rounds of each one's least of repeats."""
    modules = {"today": suffix, args.against: module_at(args.against)}
    seconds, drafts = {name: [] for name in modules}, {}
    for _ in range(args.rounds):
        for name, module in modules.items():
            spent, drafts[name] = propose_seconds(prompts, answers, args.k, args.repeats, module)
            seconds[name].append(spent)
    steps = sum(map(len, answers))
    medians = {name: 1e6 * statistics.median(values) / steps for name, values in seconds.items()}
    say(f"propose (K={args.k}, before each of {steps} answer tokens): today {medians['today']:.0f} µs, "
        f"{args.against} {medians[args.against]:.0f} µs: x{medians[args.against] / medians['today']:.2f} less today; "
        f"drafts {'identical' if drafts['today'] == drafts[args.against] else 'DIFFER'} "
        f"({sum(map(bool, drafts['today']))} of {steps} proposals drafted)")
    for config, what in ((SuffixConfig(max_cached_prompts=0), "indexed anew"), (SuffixConfig(), "trees kept")):
        seconds: dict[str, list[float]] = {name: [] for name in modules}
        for _ in range(args.rounds):
            for name, module in modules.items():
                seconds[name].append(bookkeeping_seconds(prompts, args.answer_tokens, config, args.repeats, module))
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        spread = {name: f"[{1e3 * min(v) / len(prompts):.1f}-{1e3 * max(v) / len(prompts):.1f}]"
                  for name, v in seconds.items()}
        say(f"{what}: today {1e3 * medians['today'] / len(prompts):.2f} ms a call {spread['today']}, "
            f"{args.against} {1e3 * medians[args.against] / len(prompts):.2f} {spread[args.against]}: "
            f"x{medians[args.against] / medians['today']:.2f} less today ({args.rounds} rounds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--against", metavar="REV", help="also measure suffix.py of this git revision, in turns")
    parser.add_argument("--rounds", type=int, default=5, help="turns of each side with --against")
    parser.add_argument("--k", type=int, default=5, help="tokens a proposal asks for (with --against)")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model, log=lambda _: None))
    calls = [call for turn in load_workload(args.workload) for call in turn.calls]
    prompts = [encode_messages(tokenizer, call.messages, call.tools) if call.messages is not None
               else encode_prompt(tokenizer, call.prompt or "") for call in calls]
    # the answers the workload recorded, as the proposals' stream (a call without one: none)
    answers = [tokenizer((call.recorded or {}).get("answer") or "", add_special_tokens=False)["input_ids"]
               for call in calls]
    say = Printed()
    say(f"# suffix decoding's bookkeeping, one user's {len(prompts)} calls of {args.workload} in order "
        f"({min(map(len, prompts))}-{max(map(len, prompts))}-token prompts, {args.answer_tokens}-token answers)")
    say(f"cpu: {kernels.cpu_model()}; flags: {' '.join(kernels.cpu_flags())}")
    kept = bookkeeping_seconds(prompts, args.answer_tokens, SuffixConfig(), args.repeats)
    anew = bookkeeping_seconds(prompts, args.answer_tokens, SuffixConfig(max_cached_prompts=0), args.repeats)
    say(f"every prompt indexed anew: {1e3 * anew:.1f} ms ({1e3 * anew / len(prompts):.1f} a call)")
    say(f"ended calls' prompt trees kept: {1e3 * kept:.1f} ms ({1e3 * kept / len(prompts):.1f} a call), "
        f"x{anew / kept:.2f} less")
    if args.against:
        against(say, prompts, answers, args)
    say.write(args.out)


if __name__ == "__main__":
    main()
