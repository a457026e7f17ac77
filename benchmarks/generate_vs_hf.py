"""specstand vs Hugging Face transformers on one model, dtype and thread count, in one run.

Prints tokens/s (median over prompts and repeats, runs interleaved so drift hits all alike) and ratios:
specstand `none` vs HF `generate`, specstand `ngram` vs HF prompt lookup (`prompt_lookup_num_tokens`),
plus whether each output equals plain greedy (specstand's against specstand `none`, HF prompt lookup's
against HF `generate`). Usage:

    python benchmarks/generate_vs_hf.py --model smollm2-135m --dtype bf16 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specstand.drafters import make_drafter
from specstand.engine import Engine, EngineConfig, Request
from specstand.models import load_model

AGENT_PROMPTS = [
    "Extract the filters from: 'red running shoes for men, size 42, under 80 euros'. "
    "Answer with JSON using the keys colour, category, gender, size, max_price.",
    "Return a JSON list of three search queries a shopper could type to find a waterproof hiking jacket, "
    "each as an object with keys query and reason.",
    'Rewrite this JSON so that every price is in cents: {"items": [{"name": "tea", "price": 3.5}, '
    '{"name": "mug", "price": 12.0}, {"name": "spoon", "price": 1.25}]}',
    "Write a Python function that parses a line 'key=value;key2=value2' into a dict, then show it on "
    "the input 'colour=red;size=42;brand=acme'.",
]


def _spec_bench_prompts(count: int) -> list[str]:
    path = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines()[:count]]
    return [row["turns"][0] for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--spec-bench", type=int, default=0, help="also use the first N Spec-Bench prompts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    loaded = load_model(args.model, args.dtype, log=lambda m: None)
    hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=loaded.decoder.dtype).eval()
    prompts = AGENT_PROMPTS + _spec_bench_prompts(args.spec_bench)
    encoded = [loaded.encode_messages([{"role": "user", "content": p}]) for p in prompts]
    config = EngineConfig(num_speculative_tokens=args.k, max_seq_len=loaded.max_positions)
    engines = {method: Engine(loaded.decoder, make_drafter(method), config) for method in ("none", "ngram")}
    stop = sorted(loaded.stop_token_ids)

    def run_specstand(method: str, ids: list[int]) -> tuple[list[int], float]:
        started = time.perf_counter()
        result = engines[method].generate([Request(ids, args.max_tokens, stop_token_ids=loaded.stop_token_ids)])[0]
        return result.output_ids, time.perf_counter() - started

    def run_hf(ids: list[int], lookup: int) -> tuple[list[int], float]:
        extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        started = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False,
                              eos_token_id=stop, pad_token_id=stop[0], **extra)
        return out[0, len(ids):].tolist(), time.perf_counter() - started

    runners = {
        "specstand none": lambda ids: run_specstand("none", ids),
        "specstand ngram": lambda ids: run_specstand("ngram", ids),
        "hf generate": lambda ids: run_hf(ids, 0),
        "hf prompt lookup": lambda ids: run_hf(ids, args.k),
    }
    for ids in encoded[:1]:  # warm-up
        for run in runners.values():
            run(ids[:16])
    speeds: dict[str, list[float]] = {name: [] for name in runners}
    outputs: dict[str, list[list[int]]] = {name: [] for name in runners}
    for repeat in range(args.repeats):
        for ids in encoded:
            for name, run in runners.items():
                tokens, seconds = run(ids)
                speeds[name].append(len(tokens) / seconds)
                if repeat == 0:
                    outputs[name].append(tokens)

    median = {name: statistics.median(values) for name, values in speeds.items()}
    same_ngram = sum(a == b for a, b in zip(outputs["specstand ngram"], outputs["specstand none"], strict=True))
    same_lookup = sum(a == b for a, b in zip(outputs["hf prompt lookup"], outputs["hf generate"], strict=True))
    n = len(encoded)
    print(f"model {args.model}, {args.dtype}, {args.threads} threads, {n} prompts x {args.repeats} repeats, "
          f"max {args.max_tokens} tokens, K={args.k}, exactness row unit {engines['none'].row_unit}")
    print(f"{'runner':20s} {'tok/s (median)':>15s}")
    for name, value in median.items():
        print(f"{name:20s} {value:15.2f}")
    print(f"specstand none / hf generate          x{median['specstand none'] / median['hf generate']:.2f}")
    print(f"specstand ngram / hf prompt lookup    x{median['specstand ngram'] / median['hf prompt lookup']:.2f}")
    print(f"specstand ngram / specstand none      x{median['specstand ngram'] / median['specstand none']:.2f}")
    print(f"specstand ngram identical to specstand greedy: {same_ngram}/{n}")
    print(f"hf prompt lookup identical to hf greedy:       {same_lookup}/{n}")


if __name__ == "__main__":
    main()
