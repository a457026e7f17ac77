"""What serving costs: the same calls, U at a time, through `specstand serve` (HTTP, the engine on its thread)
and through the engine alone in this process, rounds alternating which goes first. Prints each side's seconds
by phase from the engine's own counters (the server's /metrics) and the server's ratio to the engine alone:
a decode pass should cost the same in both (the server's extra work is HTTP and tokenizing, outside passes).

    python benchmarks/server_overhead.py --workload out/demo/workload.jsonl --model smollm2-135m --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from printed import Printed

from specstand import kernels
from specstand.bench.endpoints import OpenAIEndpoint
from specstand.bench.run import start_server, wait_ready
from specstand.drafters import default_k, make_drafter
from specstand.engine import Engine, EngineConfig, Request
from specstand.engine.prefix_cache import default_store_bytes
from specstand.models import load_model
from specstand.training.data import prompt_ids
from specstand.verification import SamplingParams
from specstand.workloads import Call, load_workload


@dataclass
class Round:
    wall: float
    prompt: float  # seconds in prompt passes
    decode: float  # seconds in decode/verify passes
    decode_passes: int  # passes after each call's first token, counted per call (a shared pass once per call in it)

    @property
    def per_pass_ms(self) -> float:
        return 1e3 * self.decode / max(self.decode_passes, 1)


def batches(items: list, users: int) -> list[list]:
    return [items[i : i + users] for i in range(0, len(items), users)]


def in_process(engine: Engine, requests: list[Request], users: int) -> Round:
    engine.forget_history()
    before = (engine.times.prompt, engine.times.decode)
    started, passes = time.perf_counter(), 0
    for batch in batches(requests, users):
        passes += sum(result.stats.target_passes - 1 for result in engine.generate(batch))
    wall = time.perf_counter() - started
    return Round(wall, engine.times.prompt - before[0], engine.times.decode - before[1], passes)


def served(url: str, model: str, calls: list[Call], users: int) -> Round:
    endpoint = OpenAIEndpoint(url, model)

    async def run() -> tuple[float, dict[str, float], dict[str, float]]:
        await endpoint.reset_prefix_cache()
        before = await endpoint.scrape_metrics()
        started = time.perf_counter()
        for batch in batches(calls, users):
            await asyncio.gather(*(endpoint.complete(call) for call in batch))
        wall = time.perf_counter() - started
        after = await endpoint.scrape_metrics()
        await endpoint.close()
        return wall, before, after

    wall, before, after = asyncio.run(run())

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    passes = int(delta("specstand:target_passes_total")) - len(calls)
    return Round(wall, delta("specstand:engine_seconds_total[phase=prompt]"),
                 delta("specstand:engine_seconds_total[phase=decode]"), passes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--method", default="none")
    parser.add_argument("--calls", type=int, default=8, help="the workload's first calls, in order")
    parser.add_argument("--users", type=int, default=1, help="calls sent together (each batch waits for the last)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-batch", type=int, default=8, help="cache slots on both sides (serve's default)")
    parser.add_argument("--max-seq-len", type=int, default=2304)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    say = Printed()

    calls = [call for turn in load_workload(args.workload) for call in turn.calls][: args.calls]
    target = start_server(args.method, args.model, None, args.max_batch, args.dtype, args.max_seq_len)
    try:
        model = load_model(args.model, args.dtype, args.max_seq_len, log=lambda _: None)
        drafter = make_drafter(args.method, model.decoder, args.model, tokenizer=model.tokenizer)
        engine = Engine(model.decoder, drafter, EngineConfig(default_k(drafter, None), model.max_positions,
                                                             args.max_batch, prefix_store_bytes=default_store_bytes()))
        requests = [Request(prompt_ids(model, c), c.max_tokens, SamplingParams(), model.stop_token_ids, tools=c.tools)
                    for c in calls]
        wait_ready(target)
        say(f"# {args.model} {args.dtype}, method {args.method}: {len(calls)} calls of {args.workload.name}, "
            f"{args.users} at a time, {args.rounds} rounds; torch threads {torch.get_num_threads()}")
        say(f"cpu: {kernels.cpu_model()}; flags: {' '.join(kernels.cpu_flags())}; kernel path: {kernels.best_path()}")
        bandwidth = [kernels.read_bandwidth_gbs()]
        in_process(engine, requests[:1], 1)  # warm-up, both sides
        served(target.url, args.model, calls[:1], 1)
        sides: dict[str, list[Round]] = {"engine alone": [], "server": []}
        for round_ in range(args.rounds):
            order = ["engine alone", "server"] if round_ % 2 == 0 else ["server", "engine alone"]
            for side in order:
                result = (in_process(engine, requests, args.users) if side == "engine alone"
                          else served(target.url, args.model, calls, args.users))
                sides[side].append(result)
            bandwidth.append(kernels.read_bandwidth_gbs())
        say(f"read bandwidth: {min(bandwidth):.1f}-{max(bandwidth):.1f} GB/s")
        say()
        say("side | wall s per round | prompt s | decode s | decode passes | ms per decode pass (median)")
        for side, rounds in sides.items():
            say(f"{side} | {' '.join(f'{r.wall:.2f}' for r in rounds)} | {' '.join(f'{r.prompt:.2f}' for r in rounds)} "
                f"| {' '.join(f'{r.decode:.2f}' for r in rounds)} | {rounds[0].decode_passes} | "
                f"{statistics.median(r.per_pass_ms for r in rounds):.1f}")
        say()
        alone, server = sides["engine alone"], sides["server"]
        for label, value in (("wall", lambda r: r.wall), ("prompt passes", lambda r: r.prompt),
                             ("a decode pass", lambda r: r.per_pass_ms)):
            ratios = [value(s) / value(a) for s, a in zip(server, alone, strict=True)]
            say(f"server / engine alone, {label}: {' '.join(f'x{r:.2f}' for r in ratios)} "
                f"(median x{statistics.median(ratios):.2f})")
        say.write(args.out)
    finally:
        target.process.terminate()
        try:
            target.process.wait(timeout=30)
        except Exception:  # noqa: BLE001
            target.process.kill()


if __name__ == "__main__":
    main()
