"""What one target pass costs, against its roofline, on this CPU: the compiled kernels beside torch.

For a preset: ms per whole-model decode/verify pass at 1..64 rows (the compiled forward and the Python
forward on torch's GEMMs; the compiled passes also with all the rows in one request, as a verify), prompt
tokens/s, plain greedy decode tok/s (specstand and HF transformers `generate`) against the weight-read floor.
Memory bandwidth (1 GiB fp32 sum) and the peak multiply-accumulate rate (a register-only loop of the kernel
path's instruction, times threads) are measured in the same run; each pass prints its roofline
max(weight bytes / bandwidth, MACs / peak).
`--profile` splits a speculative step into target pass and the rest (drafting, verification, bookkeeping).
`--calls WORKLOAD` times whole agent calls (prompt with its tools + `--tokens` answer tokens, fresh state per
call): specstand plain and with `--method` (adaptive verification, answers compared), and llama-cpp-python's
plain decoding where `--llama-cpp-python` is given; prompts of >= 512 tokens are measured on both sides.

    python benchmarks/pass_cost.py --model qwen2.5-coder-0.5b \
        --out benchmarks/results/kernels/pass_cost_qwen2.5-coder-0.5b.txt
    python benchmarks/pass_cost.py --model qwen2.5-coder-0.5b --dtype q8_0   # Q8_0 blocks through the kernels
    python benchmarks/pass_cost.py --model qwen2.5-coder-0.5b --calls cfb.jsonl --llama-cpp-python PYTHON
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from printed import Printed

from specstand import kernels
from specstand.drafters import default_k, make_drafter
from specstand.engine import Engine, EngineConfig, Request
from specstand.models import load_model
from specstand.models.chat import render_chat
from specstand.models.presets import PRESETS, download_gguf
from specstand.runner import PassInput, TargetRunner
from specstand.runner.runner import PREFILL_BLOCK, PROMPT_CHUNK
from specstand.workloads.format import load_workload

ROWS = (1, 2, 4, 8, 16, 32, 64)
PROMPT = "Return a JSON object with the keys name, city and age for a 30-year-old called Ana from Porto."
LONG_PROMPT_TOKENS = 512  # at least: agent calls' prompts are this long or longer


BYTES_PER_WEIGHT = {"bf16": 2.0, "q8_0": 34 / 32}  # q8_0: an int8 a weight and an fp16 scale per 32


def weight_bytes_and_macs(runner: TargetRunner, dtype: str) -> tuple[int, int]:
    """Bytes of the weight matrices a decode pass reads (every layer's linears and the head; norms and the
    looked-up embedding rows add well under 1%) and its multiply-accumulates per row (linears only)."""
    macs = sum(t.numel() for t in runner.model.linear_weights())
    return int(macs * BYTES_PER_WEIGHT[dtype]), macs


def peak_rates(path: str, dtype: str, threads: int) -> dict[bool, float]:
    """Peak multiply-accumulates per second of the kernel instruction a pass uses, by whether it has 16 rows
    or more (the q8_0 kernel takes AMX-INT8 from 16 rows on amx CPUs, vpdpbusd below)."""
    if path == "python":
        return {False: float("nan"), True: float("nan")}
    if dtype == "q8_0":
        return {tiles: kernels.peak_macs_per_second_q8_0(path, tiles) * threads for tiles in (False, True)}
    rate = kernels.peak_macs_per_second(path) * threads
    return {False: rate, True: rate}


def pass_inputs(slots: list[int], rows: int) -> tuple[list[PassInput], int]:
    """`rows` rows spread over the slots, up to 8 rows a request (one slot: all of them in one request)."""
    per = max(1, -(-rows // len(slots)))
    return [PassInput(slots[i], [17] * min(per, rows - i * per)) for i in range(-(-rows // per))], per


def time_pass(runner: TargetRunner, slots: list[int], rows: int, repeats: int, context: int) -> float:
    """Median seconds of one pass of `rows` rows spread over the slots, each request's cache `context` long."""
    return time_passes(runner, {rows: pass_inputs(slots, rows)}, slots, repeats, context)[0][rows]


def time_passes(runner: TargetRunner, cases: dict, slots: list[int], repeats: int,
                context: int) -> tuple[dict, dict]:
    """Median seconds of each case's pass (cases: key -> (inputs, rows per request)), the cases run in turn
    within every repeat so that the host's drifting bandwidth reaches them all alike; and, where the forward
    is compiled, each case's mean seconds per phase."""
    times: dict = {key: [] for key in cases}
    phases: dict = {key: {} for key in cases}
    compiled = runner.compiled
    for _ in range(repeats):
        for key, (inputs, per) in cases.items():
            for slot in slots:
                runner.cache.rollback(slot, context)
            if compiled is not None:
                compiled.take_profile()
            started = time.perf_counter()
            runner.run(inputs, per)
            times[key].append(time.perf_counter() - started)
            if compiled is not None:
                for phase, seconds in compiled.take_profile().items():
                    phases[key][phase] = phases[key].get(phase, 0.0) + seconds / repeats
    return {key: statistics.median(t) for key, t in times.items()}, phases


def prompt_tokens_per_second(runner: TargetRunner, slot: int, prompt: list[int]) -> float:
    times = []
    for _ in range(3):
        runner.cache.rollback(slot, 0)
        started = time.perf_counter()
        runner.prefill(slot, prompt)
        times.append(time.perf_counter() - started)
    return len(prompt) / statistics.median(times)


def decode_tokens_per_second(loaded, prompt_ids: list[int], tokens: int) -> float:
    engine = Engine(loaded.decoder, None, EngineConfig(0, 1024, 1))
    engine.generate([Request(prompt_ids, 4)])  # warm-up
    started = time.perf_counter()
    result = engine.generate([Request(prompt_ids, tokens)])[0]
    return len(result.output_ids) / (time.perf_counter() - started)


def hf_tokens_per_second(path: str, prompt_ids: list[int], tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        hf.generate(torch.tensor([prompt_ids]), max_new_tokens=4, do_sample=False)
        started = time.perf_counter()
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return (out.shape[1] - len(prompt_ids)) / (time.perf_counter() - started)


def llama_cpp_figures(python: str, model: str, prompt_text: str, long_text: str, calls: list[str], tokens: int,
                      threads: int) -> tuple[dict, int]:
    """benchmarks/peers/llama_cpp_bench.py run by `python` (one with llama-cpp-python) on the preset's own
    GGUF (also the long prompt and the calls' prompt texts); returns its figures and the GGUF's size in bytes."""
    with tempfile.TemporaryDirectory() as work:
        gguf, prompt_file = Path(work) / "model.gguf", Path(work) / "prompt.txt"
        long_file, calls_file = Path(work) / "long.txt", Path(work) / "calls.json"
        download_gguf(PRESETS[model], Path(work), gguf, log=lambda _: None)
        prompt_file.write_text(prompt_text)
        long_file.write_text(long_text)
        calls_file.write_text(json.dumps(calls))
        script = Path(__file__).parent / "peers" / "llama_cpp_bench.py"
        command = [python, str(script), str(gguf), "--prompt-file", str(prompt_file), "--tokens", str(tokens),
                   "--threads", str(threads), "--long-prompt-file", str(long_file)]
        if calls:
            command += ["--calls-file", str(calls_file)]
        out = subprocess.run(command, check=True, capture_output=True, text=True)
        return json.loads(out.stdout.strip().splitlines()[-1]), gguf.stat().st_size


def long_prompt(loaded, chat: bool) -> tuple[str, list[int]]:
    """PROMPT repeated in one user message until it makes LONG_PROMPT_TOKENS tokens or more: text and ids."""
    for copies in range(1, 1000):
        content = " ".join([PROMPT] * copies)
        text = render_chat(loaded.tokenizer, [{"role": "user", "content": content}]) if chat else content
        ids = loaded.tokenizer(text, add_special_tokens=not chat)["input_ids"]
        if len(ids) >= LONG_PROMPT_TOKENS:
            return text, ids
    raise ValueError("the prompt does not grow")


def call_texts(loaded, workload: Path, limit: int) -> list[str]:
    """The prompt texts of the first `limit` calls with messages in a workload, tools rendered as the server
    renders them."""
    calls = [call for turn in load_workload(workload) for call in turn.calls if call.messages]
    return [render_chat(loaded.tokenizer, call.messages, call.tools) for call in calls[:limit]]


def call_seconds(loaded, method: str, prompt_ids: list[int], tokens: int) -> tuple[float, list[int]]:
    """Seconds of one whole call (prompt + `tokens` answer tokens, no stop token) on a fresh engine, and the answer."""
    drafter = make_drafter(method, loaded.decoder, tokenizer=loaded.tokenizer)
    config = EngineConfig(default_k(drafter, None), len(prompt_ids) + tokens + 64, 1)
    engine = Engine(loaded.decoder, drafter, config)
    started = time.perf_counter()
    result = engine.generate([Request(prompt_ids, tokens)])[0]
    return time.perf_counter() - started, result.output_ids


def profile_step(loaded, prompt_ids: list[int], tokens: int) -> tuple[float, float]:
    """Seconds in target passes and in everything else, over an n-gram-drafted greedy answer."""
    engine = Engine(loaded.decoder, make_drafter("ngram"), EngineConfig(7, 1024, 1, adaptive=False))  # a full K
    spent = [0.0]
    run = engine.runner.run

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - started

    engine.runner.run = timed
    engine.add_request(Request(prompt_ids, tokens))
    engine.step()  # admission: the prompt pass
    spent[0] = 0.0
    started = time.perf_counter()
    while engine.has_work:
        engine.step()
    total = time.perf_counter() - started
    return spent[0], total - spent[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16", choices=list(BYTES_PER_WEIGHT),
                        help="weights of the compiled passes (the torch column runs bf16 of the same values)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated for the decode figures")
    parser.add_argument("--context", type=int, default=256, help="cache length every measured row attends over")
    parser.add_argument("--profile", action="store_true",
                        help="also split passes into linears / attention / head / rest, and a step into pass / rest")
    parser.add_argument("--out", type=Path, help="also write the report here")
    parser.add_argument("--llama-cpp-python", metavar="PYTHON",
                        help="a Python with llama-cpp-python (source build): also measure it on the preset's GGUF")
    parser.add_argument("--calls", type=Path, metavar="WORKLOAD", help="also time whole calls of this workload")
    parser.add_argument("--calls-limit", type=int, default=4, help="how many of its calls")
    parser.add_argument("--method", default="suffix", help="the drafted method the calls also run with")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    say = Printed()

    capacity = max(4096, args.context + 64)
    loaded = load_model(args.model, args.dtype, max_seq_len=capacity, log=lambda m: None)
    compiled = loaded.decoder.compiled
    path = compiled.path if compiled is not None else getattr(loaded.decoder, "kernel_path", "python")
    say(f"# pass cost: {args.model} {args.dtype}, {args.threads} threads")
    say(f"cpu: {kernels.cpu_model()}; flags: {' '.join(kernels.cpu_flags())}; kernel path: {path}")
    peaks = peak_rates(path, args.dtype, args.threads)
    # a hybrid target (Gemma 3, LFM2, Qwen3.5) has no compiled forward: its Python forward with the
    # compiled linears is "compiled" here, the same forward on torch's linears is "torch"
    linears = loaded.decoder.linears() if compiled is None and path != "python" else []
    runner = TargetRunner(loaded.decoder, 8, capacity)
    slots = [runner.cache.allocate() for _ in range(8)]
    for slot in slots:
        runner.prefill(slot, list(range(100, 100 + args.context)))
    weight_bytes, macs = weight_bytes_and_macs(runner, args.dtype)
    bandwidth = kernels.read_bandwidth_gbs()
    floor_ms = weight_bytes / bandwidth / 1e6
    say(f"weights read per pass {weight_bytes / 1e6:.0f} MB; bandwidth {bandwidth:.1f} GB/s -> floor "
        f"{floor_ms:.1f} ms; peak {' / '.join(f'{rate / 1e9:.0f}' for rate in dict.fromkeys(peaks.values()))} "
        f"GMAC/s ({path} {args.dtype}{', rows < 16 / from 16' if len(set(peaks.values())) > 1 else ''}, "
        f"{args.threads} cores)")
    say(f"every row attends over {args.context} cached positions of its request (up to 8 rows a request; "
        f"\"one request\": all the rows in one request, a verify of K = rows - 1 drafted tokens)")
    say()
    if linears:
        say("(compiled: the Python forward with the compiled linears; torch: with torch's)")
    say("rows | compiled ms | x one row | roofline ms | x roofline | torch ms | torch/compiled | "
        "one request ms | x one row")
    say("-----|-------------|-----------|-------------|------------|----------|----------------|"
        "----------------|----------")
    # the compiled passes of every row count, spread over requests and in one request, interleaved
    spread = {("spread", rows): pass_inputs(slots, rows) for rows in ROWS}
    alone = {("alone", rows): pass_inputs(slots[:1], rows) for rows in ROWS}
    measured = compiled is not None or bool(linears)
    ours_by, phases_by = ({}, {}) if not measured else time_passes(runner, spread | alone, slots, args.repeats,
                                                                    args.context)
    splits = {rows: phases_by[("spread", rows)] for rows in ROWS} if compiled is not None else {}
    nan = float("nan")
    one_row, one_row_alone = ours_by.get(("spread", 1), nan), ours_by.get(("alone", 1), nan)
    for rows in ROWS:
        ours, verify = ours_by.get(("spread", rows), nan), ours_by.get(("alone", rows), nan)
        runner.compiled = None
        packed = [lin.packed for lin in linears]
        for lin in linears:
            lin.packed = None
        theirs = time_pass(runner, slots, rows, args.repeats, args.context)
        runner.compiled = compiled
        for lin, pack in zip(linears, packed, strict=True):
            lin.packed = pack
        roofline = max(floor_ms, rows * macs / peaks[rows >= 16] * 1e3)
        say(f"{rows:4d} | {ours * 1e3:11.1f} | {ours / one_row:9.2f} | {roofline:11.1f} | "
            f"{ours * 1e3 / roofline:10.2f} | {theirs * 1e3:8.1f} | {theirs / ours:14.2f} | {verify * 1e3:14.1f} | "
            f"{verify / one_row_alone:9.2f}")
    if args.profile and splits:
        say()
        say("rows | linears ms | attention ms | head ms | rest ms   (inside a compiled pass; means of the repeats)")
        for rows, split in splits.items():
            say(f"{rows:4d} | {split['linear'] * 1e3:10.1f} | {split['attention'] * 1e3:12.1f} | "
                f"{split['head'] * 1e3:7.1f} | {split['other'] * 1e3:7.1f}")
    say()
    chat = getattr(loaded.tokenizer, "chat_template", None)  # a base model (gemma3-270m) takes the plain text
    prompt_ids = loaded.encode_messages([{"role": "user", "content": PROMPT}]) if chat else loaded.encode_prompt(PROMPT)
    long_text, prompt = long_prompt(loaded, chat)
    rates = {}
    for name, compiled_prompts in (("compiled", True), ("torch", False)):
        if compiled_prompts and compiled is None:
            continue
        runner.compiled_prompts = compiled_prompts
        rates[name] = prompt_tokens_per_second(runner, slots[0], prompt)
    runner.compiled_prompts = compiled is not None and compiled.fast_for_prompts
    used = "compiled" if runner.compiled_prompts else "torch"
    if linears:  # prompts run the Python forward in 64-row blocks, through the compiled linears
        rates = {"python forward + compiled linears": rates["torch"]}
        used = "that"
    measured = ", ".join(f"{name} {rate:.0f} tokens/s" for name, rate in rates.items())
    say(f"prompt ({len(prompt)} tokens; compiled: {PROMPT_CHUNK}-row passes, torch: {PREFILL_BLOCK}-row blocks): "
        f"{measured}; the engine uses {used} on this path")
    ours = decode_tokens_per_second(loaded, prompt_ids, args.tokens)
    floor_tps = 1e3 / floor_ms
    say(f"plain decode: specstand {ours:.1f} tok/s = {ours / floor_tps:.0%} of the weight-read floor "
        f"({floor_tps:.1f} tok/s at {bandwidth:.1f} GB/s)")
    hf = hf_tokens_per_second(loaded.path, prompt_ids, args.tokens)
    say(f"plain decode: HF transformers generate {hf:.1f} tok/s (specstand x{ours / hf:.2f})")
    texts = call_texts(loaded, args.calls, args.calls_limit) if args.calls else []
    used_rate = used if used in rates else next(iter(rates))
    peer = None
    if args.llama_cpp_python:
        text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                    tokenize=False)
        peer, size = llama_cpp_figures(args.llama_cpp_python, args.model, text, long_text, texts, args.tokens,
                                       args.threads)
        say(f"llama-cpp-python on the preset's GGUF ({size / 1e6:.0f} MB as published, against our "
            f"{weight_bytes / 1e6:.0f} MB of {args.dtype}): plain {peer['plain_tokens_per_s']:.1f} tok/s (specstand "
            f"x{ours / peer['plain_tokens_per_s']:.2f}), prompt lookup {peer['prompt_lookup_tokens_per_s']:.1f} "
            f"tok/s; its speculative answer {'equals' if peer['speculative_equals_plain'] else 'DIFFERS from'} its "
            f"plain one; prompt {peer['long_prompt_tokens_per_s']:.0f} tokens/s ({peer['long_prompt_tokens']} "
            f"tokens; specstand x{rates[used_rate] / peer['long_prompt_tokens_per_s']:.2f})")
    if texts:
        say()
        say(f"whole calls of {args.calls.name} (prompt with its tools + {args.tokens} tokens, fresh state per call; "
            f"{args.method} with adaptive verification):")
        say(f"call | prompt tokens | plain s | {args.method} s | x plain | identical"
            + (" | llama.cpp plain s | x llama.cpp" if peer else ""))
        totals = [0.0, 0.0, 0.0]
        for i, text in enumerate(texts):
            ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
            plain, plain_ids = call_seconds(loaded, "none", ids, args.tokens)
            drafted, drafted_ids = call_seconds(loaded, args.method, ids, args.tokens)
            theirs = peer["call_seconds"][i] if peer else float("nan")
            totals = [totals[0] + plain, totals[1] + drafted, totals[2] + theirs]
            same = "yes" if plain_ids == drafted_ids else "NO"
            peer_cells = f" | {theirs:17.2f} | {theirs / drafted:12.2f}" if peer else ""
            say(f"{i:4d} | {len(ids):13d} | {plain:7.2f} | {drafted:7.2f} | {plain / drafted:7.2f} | {same:>9}"
                + peer_cells)
        peer_cells = f" | {totals[2]:17.2f} | {totals[2] / totals[1]:12.2f}" if peer else ""
        say(f" all | {'':13} | {totals[0]:7.2f} | {totals[1]:7.2f} | {totals[0] / totals[1]:7.2f} | {'':9}{peer_cells}")
    say(f"bandwidth after the run: {kernels.read_bandwidth_gbs():.1f} GB/s")
    if args.profile:
        target, rest = profile_step(loaded, prompt_ids, args.tokens)
        say(f"profile (ngram, K=7, {args.tokens} tokens): target passes {target:.2f} s, drafting + "
            f"verification + bookkeeping {rest:.2f} s ({rest / (target + rest):.0%} of a step)")
    say.write(args.out)


if __name__ == "__main__":
    main()
