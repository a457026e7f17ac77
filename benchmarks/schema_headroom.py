"""How much tau a training-free drafter can still find on held-out tool calls: a bound from plain answers.

The held-out calls of `schema_tau.py` are answered by plain greedy decoding. Each answer token is then marked
*made up* where it holds a character of a JSON value (a string's text or a number) that the request's
messages and tools do not contain: a coordinate, a date, an id the model invents. An oracle that drafts every
other token right (the structure, function names, keys, whitespace, values the prompt holds) and no made-up
token reaches the tau printed here at a fixed K. A drafter beats it only by guessing made-up values (from
earlier answers, a layout); what it misses outside them is what is left to build.

    PYTHONPATH=. python benchmarks/schema_headroom.py --model qwen2.5-coder-0.5b --turns 20 --k 5
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from printed import Printed
from schema_tau import SOURCES, HeldOutCall, chat_request, heldout_turns, run_method

from specstand import kernels
from specstand.drafters.json_parts import answer_structure
from specstand.drafters.json_reader import AnswerReader
from specstand.models import load_model
from specstand.workloads import Call


def made_up_chars(text: str, call: Call) -> list[bool]:
    """Per character of an answer: whether it lies in a JSON value whose text the request does not hold."""
    request = json.dumps(call.messages, ensure_ascii=False) + json.dumps(call.tools, ensure_ascii=False)
    request += " ".join(str(message.get("content")) for message in call.messages)  # unescaped, as a model reads it
    reader = AnswerReader(answer_structure(call.tools, None))
    made_up, start = [False] * len(text), None
    for at, char in enumerate(text):
        reader.feed(char)
        inside = reader.open_value() is not None
        if inside and start is None:
            start = at
        elif not inside and start is not None:
            value = text[start:at].lstrip('"')
            if value and value not in request:
                made_up[start:at] = [True] * (at - start)
            start = None
    return made_up


def oracle_passes(made_up_tokens: list[bool], k: int) -> int:
    """Target passes of the oracle: the prompt's pass gives the first token; each later pass accepts the drafted
    tokens up to the first made-up one (k at most) and adds one of its own."""
    position, passes = 1, 1
    while position < len(made_up_tokens):
        accepted = 0
        while accepted < k and position + accepted < len(made_up_tokens) and not made_up_tokens[position + accepted]:
            accepted += 1
        position += accepted + 1
        passes += 1
    return passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--turns", type=int, default=3, help="held-out turns of each data set, in order")
    parser.add_argument("--k", type=int, default=5, help="draft tokens verified per pass (fixed)")
    parser.add_argument("--max-tokens", type=int, default=128, help="answer budget cap per call")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    say = Printed()

    model = load_model(args.model, args.dtype, 4096, log=lambda _: None)
    turns = [turn for source in SOURCES for turn in heldout_turns(source, args.turns, args.max_tokens)]
    calls = [(index == 0, call) for turn in turns for index, call in enumerate(turn.calls)]
    requests = [HeldOutCall("", first, chat_request(model, call)) for first, call in calls]
    context = max(len(r.request.prompt_ids) + r.request.max_tokens for r in requests) + 16
    answers = run_method(model, "none", requests, 0, context).answers

    totals = {True: [0, 0, 0], False: [0, 0, 0]}  # tokens, made-up tokens, oracle passes
    for (first, call), answer in zip(calls, answers, strict=True):
        made_up = made_up_chars(model.tokenizer.decode(answer), call)
        spans, end = [], 0
        for count in range(1, len(answer) + 1):  # each token's characters (decoded with those before it)
            text_end = len(model.tokenizer.decode(answer[:count]))
            spans.append(any(made_up[end:text_end]))
            end = text_end
        totals[first][0] += len(answer)
        totals[first][1] += sum(spans)
        totals[first][2] += oracle_passes(spans, args.k)
    say(f"# schema headroom: {args.model} {args.dtype}, greedy, K={args.k}; {len(calls)} held-out calls of "
        f"{args.turns} turns each of {', '.join(SOURCES)}")
    say(f"cpu: {kernels.cpu_model()}; flags: {' '.join(kernels.cpu_flags())}; kernel path: {kernels.best_path()} "
        "(plain answers may differ between paths: they round differently)")
    say("calls | tokens | made-up tokens | oracle passes | oracle tau")
    say("------|--------|----------------|---------------|-----------")
    for first in (True, False):
        tokens, made_up_count, passes = totals[first]
        say(f"{'first' if first else 'later'} | {tokens} | {made_up_count} ({made_up_count / tokens:.0%}) | {passes} | "
            f"{tokens / passes:.2f}")
    tokens, passes = totals[True][0] + totals[False][0], totals[True][2] + totals[False][2]
    say(f"all | {tokens} | {totals[True][1] + totals[False][1]} | {passes} | {tokens / passes:.2f}")
    say.write(args.out)


if __name__ == "__main__":
    main()
