"""Plain decoding and a long prompt through specstand on one thread, in the process's CPU time: the specstand side
of benchmarks/results/peers/avx2_vs_llama_cpp_cpu_time.txt. It writes the prompt texts it used into FOLDER (long.txt,
short.txt) for llama_cpp_bench.py --clock cpu --threads 1 to read.

    SPECSTAND_KERNEL_PATH=avx2 python benchmarks/peers/specstand_cpu_time.py qwen2.5-coder-0.5b q8_0 FOLDER
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from specstand.engine import Engine, EngineConfig, Request
from specstand.models import load_model

# benchmarks/pass_cost.py's prompt
PROMPT = "Return a JSON object with the keys name, city and age for a 30-year-old called Ana from Porto."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("dtype")
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(args.model, args.dtype, max_seq_len=1024, log=lambda _: None)
    texts = {name: loaded.tokenizer.apply_chat_template([{"role": "user", "content": " ".join([PROMPT] * copies)}],
                                                       add_generation_prompt=True, tokenize=False)
             for name, copies in (("long", 24), ("short", 1))}
    args.folder.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (args.folder / f"{name}.txt").write_text(text)
    ids = {name: loaded.tokenizer(text, add_special_tokens=False)["input_ids"] for name, text in texts.items()}

    def cpu_seconds(prompt: list[int], tokens: int) -> float:
        engine = Engine(loaded.decoder, None, EngineConfig(0, 1024, 1))
        started = time.process_time()
        engine.generate([Request(prompt, tokens)])
        return time.process_time() - started

    cpu_seconds(ids["short"], 4)  # warm
    prompt = min(cpu_seconds(ids["long"], 1) for _ in range(2))
    decode = min((cpu_seconds(ids["short"], 33) - cpu_seconds(ids["short"], 1)) / 32 for _ in range(2))
    path = loaded.decoder.compiled.path if loaded.decoder.compiled is not None else "python"
    print(f"{args.model} {args.dtype} path {path}: prompt {len(ids['long'])} tokens {len(ids['long']) / prompt:.1f} "
          f"tok/s; decode {1 / decode:.1f} tok/s (1 thread, process CPU time)")


if __name__ == "__main__":
    main()
