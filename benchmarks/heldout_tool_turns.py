"""Held-out ComplexFuncBench and NESTFUL turns as a workload for `specstand bench`, tools in the `tools` field.

The same turns `schema_tau.py` answers (those `specstand train-data` holds out, imported with the drafter data's
limits), every call of each, so the stand replays them as an agent sends them: chained calls, each with the
offered functions as OpenAI `tools`.

    PYTHONPATH=. python benchmarks/heldout_tool_turns.py --turns 3 --out out/heldout_tools.jsonl
    specstand bench --workload out/heldout_tools.jsonl --model qwen2.5-coder-0.5b \
        --method none,schema,suffix,ngram,eagle3 --users 1,4 --repeats 2 --out out/stand_tools
"""

from __future__ import annotations

import argparse
from pathlib import Path

from schema_tau import SOURCES, heldout_turns

from specstand.workloads.format import save_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=3, help="held-out turns of each data set, in order")
    parser.add_argument("--max-tokens", type=int, default=128, help="answer budget cap per call")
    parser.add_argument("--out", type=Path, required=True, help="workload file (JSON Lines) to write")
    args = parser.parse_args()
    if args.max_tokens < 1 or args.turns < 1:
        parser.error("--max-tokens and --turns must be >= 1")
    turns = [turn for source in SOURCES for turn in heldout_turns(source, args.turns, args.max_tokens)]
    save_workload(turns, args.out)
    calls = sum(len(turn.calls) for turn in turns)
    print(f"wrote {len(turns)} turns, {calls} calls ({sum(bool(c.tools) for t in turns for c in t.calls)} with tools) "
          f"to {args.out}: {', '.join(turn.turn_id for turn in turns)}")


if __name__ == "__main__":
    main()
