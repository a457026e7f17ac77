"""Schema drafting's tau on held-out agent calls, beside suffix decoding and n-grams: token counts only.

Held-out ComplexFuncBench and NESTFUL turns (the turns `specstand train-data --heldout 0.15` holds out, as
imported with the Makefile's limits) are answered one call at a time, in turn order, by plain greedy
decoding and by each method at a fixed K (adaptive verification off, so every draft is verified whole).
Each call is sent as an OpenAI client sends it: its messages and its `tools`, rendered by the chat template
and handed to the drafters. Per method: tau (tokens per target pass, over all passes, the prompt's included)
overall, on the first call of each turn (no earlier answer of the turn to copy) and on later calls; the
acceptance at each draft position; and whether every answer is token-identical to plain decoding's. No
timing: the figures do not depend on the machine's load.

    PYTHONPATH=. python benchmarks/schema_tau.py --model qwen2.5-coder-0.5b --turns 3 --out FILE
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
from printed import Printed

from specstand import kernels
from specstand.drafters import make_drafter
from specstand.engine import Engine, EngineConfig, Request
from specstand.engine.stats import DecodeStats
from specstand.models import load_model
from specstand.models.loading import LoadedModel
from specstand.training.data import heldout_turn
from specstand.workloads import Call, Turn
from specstand.workloads.importers import import_tool_calls, nestful_wheel

SOURCES = ("complexfuncbench", "nestful")
HELDOUT_SHARE = 0.15  # train-data's default split
MAX_PROMPT_CHARS, MAX_RESULT_CHARS = 3000, 600  # the Makefile's drafter data; the importer's default


@dataclass
class HeldOutCall:
    source: str
    first: bool  # the first call of its turn
    request: Request


@dataclass
class MethodRun:
    answers: list[list[int]]
    finish_reasons: list[str]
    stats: list[DecodeStats]


def heldout_turns(source: str, turns: int, max_tokens: int) -> list[Turn]:
    imported = import_tool_calls(source, nestful_wheel(log=lambda _: None), None, MAX_RESULT_CHARS,
                                 MAX_PROMPT_CHARS, max_tokens)
    return [turn for turn in imported if heldout_turn(turn.turn_id, HELDOUT_SHARE)][:turns]


def chat_request(model: LoadedModel, call: Call) -> Request:
    """The request a chat completion with `tools` becomes: the template renders them into the prompt and
    the drafters read them."""
    return Request(model.encode_messages(call.messages, call.tools), call.max_tokens,
                   stop_token_ids=model.stop_token_ids, tools=call.tools)


def run_method(model: LoadedModel, method: str, calls: list[HeldOutCall], k: int, context: int) -> MethodRun:
    """Every call in order through one engine (the drafter sees the earlier answers, as a server's would)."""
    drafter = make_drafter(method, model.decoder, model.name, tokenizer=model.tokenizer)
    engine = Engine(model.decoder, drafter, EngineConfig(k, context, 1, adaptive=False))
    results = [engine.generate([call.request])[0] for call in calls]
    return MethodRun([r.output_ids for r in results], [r.finish_reason for r in results], [r.stats for r in results])


def merged(stats: list[DecodeStats]) -> DecodeStats:
    total = DecodeStats()
    for one in stats:
        total.merge(one)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--methods", default="schema,suffix,ngram", help="compared with plain decoding")
    parser.add_argument("--baseline", default="suffix", help="the method the ratios divide by")
    parser.add_argument("--turns", type=int, default=3, help="held-out turns of each data set, in order")
    parser.add_argument("--k", type=int, default=5, help="draft tokens verified per pass (fixed)")
    parser.add_argument("--max-tokens", type=int, default=128, help="answer budget cap per call")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--answers", action="store_true", help="also print plain decoding's answers")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    say = Printed()

    model = load_model(args.model, args.dtype, 4096, log=lambda _: None)
    calls = [HeldOutCall(source, index == 0, chat_request(model, call))
             for source in SOURCES for turn in heldout_turns(source, args.turns, args.max_tokens)
             for index, call in enumerate(turn.calls)]
    context = max(len(c.request.prompt_ids) + c.request.max_tokens for c in calls) + args.k + 16
    firsts = [i for i, c in enumerate(calls) if c.first]
    say(f"# schema tau: {args.model} {args.dtype}, greedy, K={args.k} fixed (adaptive off); {len(calls)} held-out "
        f"calls ({len(firsts)} first of their turn) of {args.turns} turns each of {', '.join(SOURCES)}")
    say(f"cpu: {kernels.cpu_model()}; flags: {' '.join(kernels.cpu_flags())}; kernel path: {kernels.best_path()}")
    plain = run_method(model, "none", calls, 0, context)
    cut = sum(reason == "length" for reason in plain.finish_reasons)
    say(f"plain decoding: {sum(map(len, plain.answers))} tokens, {cut} of {len(calls)} answers cut by max_tokens")
    if args.answers:
        for call, answer in zip(calls, plain.answers, strict=True):
            say(f"  {call.source} {'first' if call.first else 'later'}: {model.tokenizer.decode(answer)!r}")
    say()
    say("method | tau all | tau first | tau later | x base all | x base first | identical | acceptance per position")
    say("-------|---------|-----------|-----------|------------|--------------|-----------|------------------------")
    runs = {method: run_method(model, method, calls, args.k, context) for method in args.methods.split(",")}
    later = [i for i in range(len(calls)) if i not in firsts]
    taus = {method: (merged(run.stats).tau, merged([run.stats[i] for i in firsts]).tau,
                     merged([run.stats[i] for i in later]).tau) for method, run in runs.items()}
    base_all, base_first, _ = taus.get(args.baseline, (float("nan"),) * 3)
    for method, run in runs.items():
        every, first, rest = taus[method]
        same = sum(a == b for a, b in zip(run.answers, plain.answers, strict=True))
        acceptance = " ".join(f"{a:.2f}" for a in merged(run.stats).acceptance_per_position)
        say(f"{method} | {every:.2f} | {first:.2f} | {rest:.2f} | {every / base_all:.2f} | {first / base_first:.2f} | "
            f"{'yes' if same == len(calls) else 'NO'} ({same}/{len(calls)}) | {acceptance}")
    say.write(args.out)


if __name__ == "__main__":
    main()
