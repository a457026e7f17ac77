"""llama-cpp-python on a preset's own GGUF: plain and prompt-lookup greedy decoding, side by side.

Runs in a Python that has llama-cpp-python (a source build, in its own venv); `benchmarks/pass_cost.py
--llama-cpp-python PYTHON` calls it and prints what it reports. Prints one JSON object: tokens/s of
plain and prompt-lookup decoding (medians of the repeats), prompt tokens/s, and whether the speculative
answer equals the plain one token for token; with --long-prompt-file the prompt tokens/s of that text (a
long prompt: what agent calls are), with --calls-file (a JSON list of prompt texts) the seconds of each
whole call, prompt and --tokens answer tokens, fresh state per call (plain decoding, medians).

    PYTHON benchmarks/peers/llama_cpp_bench.py MODEL.gguf --prompt-file P.txt --tokens 64 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # cpu: every thread of this process, busy time only


def run(llm: Llama, prompt: list[int], tokens: int, clock=time.perf_counter) -> tuple[list[int], float, float]:
    """Greedy answer, seconds for the prompt (first token) and for the rest."""
    llm.reset()
    out: list[int] = []
    started = clock()
    first = None
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if first is None:
            first = clock()
        out.append(token)
        if len(out) >= tokens:
            break
    return out, first - started, clock() - first


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("gguf")
    parser.add_argument("--prompt-file", required=True)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long-prompt-file", help="also: prompt tokens/s of this text")
    parser.add_argument("--calls-file", help="also: seconds of each call (a JSON list of prompt texts)")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="cpu: the process's CPU time (with --threads 1, what a busy host barely moves)")
    args = parser.parse_args()
    clock = CLOCKS[args.clock]
    text = Path(args.prompt_file).read_text()
    results = {}
    answers = {}
    for name, draft in (("plain", None), ("prompt_lookup", LlamaPromptLookupDecoding(num_pred_tokens=5))):
        llm = Llama(args.gguf, n_ctx=2048, n_threads=args.threads, n_batch=512, verbose=False, draft_model=draft)
        prompt = llm.tokenize(text.encode(), add_bos=False, special=True)
        runs = [run(llm, prompt, args.tokens, clock) for _ in range(args.repeats)]
        answers[name] = runs[0][0]
        results[f"{name}_tokens_per_s"] = (args.tokens - 1) / statistics.median(r[2] for r in runs)
        results[f"{name}_prompt_tokens_per_s"] = len(prompt) / statistics.median(r[1] for r in runs)
    results["prompt_tokens"] = len(prompt)
    results["speculative_equals_plain"] = answers["plain"] == answers["prompt_lookup"]
    llm = Llama(args.gguf, n_ctx=8192, n_threads=args.threads, n_batch=512, verbose=False)
    if args.long_prompt_file:
        long = llm.tokenize(Path(args.long_prompt_file).read_text().encode(), add_bos=False, special=True)
        seconds = statistics.median(run(llm, long, 1, clock)[1] for _ in range(args.repeats))
        results["long_prompt_tokens"], results["long_prompt_tokens_per_s"] = len(long), len(long) / seconds
    if args.calls_file:
        calls = [llm.tokenize(text.encode(), add_bos=False, special=True)
                 for text in json.loads(Path(args.calls_file).read_text())]
        results["call_prompt_tokens"] = [len(call) for call in calls]
        results["call_seconds"] = [statistics.median(sum(run(llm, call, args.tokens, clock)[1:])
                                                     for _ in range(args.repeats)) for call in calls]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
