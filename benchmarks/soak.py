"""Soak: many clients against one `specstand serve` for minutes, some sending bad requests, some hanging up
mid-stream. Every good answer must equal the answer its prompt gets alone (greedy), no request may be
lost (each gets an answer or a clear error), the server's memory must stay flat, /health must stay 200.

    python benchmarks/soak.py --model smollm2-135m --method suffix --clients 16 --minutes 5 \\
        --out benchmarks/results/stand/soak_smollm2-135m.txt
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from printed import Printed

from specstand import kernels

PROMPTS = [
    "Return a JSON object with the keys name and city for Ana from Porto.",
    "List three prime numbers as a JSON array.",
    'Answer with {"ok": true} and nothing else.',
    "Write one sentence about the sea.",
    "What is 12 times 12? Reply with a number.",
    "Give a JSON object describing a cat with keys name, age and color.",
    "Name two colors of the French flag.",
    "Translate 'good morning' to Spanish.",
]
# (what a bad client sends, the status it must get): refusals, and extremes that must simply work
BAD = [
    ({"seed": 2**64}, 400), ({"temperature": 1e-320}, 200), ({"top_p": 0}, 400), ({"n": 3}, 400),
    ({"logprobs": True}, 400), ({"messages": []}, 400),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400), ({"max_tokens": -1}, 400),
    ({"max_tokens": 10**9}, 400), ({"logit_bias": {"1": 5}}, 400), ({"seed": -5, "temperature": 0.7}, 200),
]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.latencies: list[float] = []
        self.problems: list[str] = []

    def add(self, outcome: str, latency: float | None = None, problem: str | None = None) -> None:
        with self.lock:
            self.counts[outcome] = self.counts.get(outcome, 0) + 1
            if latency is not None:
                self.latencies.append(latency)
            if problem is not None and len(self.problems) < 20:
                self.problems.append(problem)


def body(prompt: str, max_tokens: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0, **extra}


def client(url: str, reference: dict[str, list[int]], tally: Tally, until: float, seed: int, max_tokens: int) -> None:
    rng = random.Random(seed)
    chat = url + "/v1/chat/completions"
    with httpx.Client(timeout=300) as http:
        while time.time() < until:
            roll, prompt = rng.random(), rng.choice(PROMPTS)
            started = time.perf_counter()
            try:
                if roll < 0.1:  # a bad request: the status it must get (a 4xx with a message, or a 200)
                    extra, status = rng.choice(BAD)
                    reply = http.post(chat, json={**body(prompt, max_tokens), **extra})
                    ok = reply.status_code == status and (status == 200 or reply.json()["error"]["message"])
                    tally.add(f"bad answered {status}" if ok else "bad answered wrongly", None,
                              None if ok else f"{extra} got {reply.status_code}: {reply.text[:120]}")
                elif roll < 0.2:  # hang up after the first chunk
                    with http.stream("POST", chat, json=body(prompt, max_tokens, stream=True)) as reply:
                        next(reply.iter_lines())
                    tally.add("hung up mid-stream")
                else:
                    reply = http.post(chat, json=body(prompt, max_tokens))
                    if reply.status_code != 200:
                        tally.add("good failed", None, f"good request got {reply.status_code}: {reply.text[:120]}")
                        continue
                    tokens = reply.json()["specstand"]["token_ids"]
                    same = tokens == reference[prompt]
                    tally.add("good, identical" if same else "good, DIFFERENT", time.perf_counter() - started,
                              None if same else f"{prompt!r}: {tokens[:12]} != {reference[prompt][:12]}")
            except (httpx.HTTPError, ValueError, KeyError) as error:
                tally.add("client error", None, f"{type(error).__name__}: {error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="suffix")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "specstand.cli", "serve", "--model", args.model, "--method",
                               args.method, "--port", str(port), "--max-batch", str(args.max_batch),
                               "--max-queue", str(4 * args.clients)], stderr=subprocess.DEVNULL)
    say = Printed()

    try:
        deadline = time.time() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(1)
        with httpx.Client(timeout=300) as http:  # each prompt alone first: the reference answers
            reference = {p: http.post(url + "/v1/chat/completions", json=body(p, args.max_tokens)).json()[
                "specstand"]["token_ids"] for p in PROMPTS}
        tally = Tally()
        until = time.time() + args.minutes * 60
        threads = [threading.Thread(target=client, args=(url, reference, tally, until, seed, args.max_tokens))
                   for seed in range(args.clients)]
        memory, health = [(0.0, rss_mb(server.pid))], []
        began = time.time()
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            time.sleep(10)
            memory.append((time.time() - began, rss_mb(server.pid)))
            health.append(httpx.get(url + "/health", timeout=10).status_code)
        for thread in threads:
            thread.join()
        time.sleep(2)
        metrics = httpx.get(url + "/metrics").text
        final_health = httpx.get(url + "/health").status_code
    finally:
        server.terminate()
        server.wait(timeout=30)

    say(f"# soak: {args.model} {args.method}, {args.clients} clients, {args.minutes:g} min, "
        f"{args.max_tokens} tokens, max batch {args.max_batch}")
    say(f"cpu: {kernels.cpu_model()}; flags: {' '.join(kernels.cpu_flags())}")
    say(f"requests by outcome: {json.dumps(dict(sorted(tally.counts.items())))}")
    if tally.latencies:
        ordered = sorted(tally.latencies)
        say(f"good request latency: p50 {statistics.median(ordered):.2f} s, "
            f"p90 {ordered[int(0.9 * (len(ordered) - 1))]:.2f} s")
    warm = [mb for t, mb in memory if t >= 60] or [mb for _, mb in memory]
    say(f"server RSS: start {memory[0][1]:.0f} MB, after the first minute {warm[0]:.0f} MB, end {memory[-1][1]:.0f} "
        f"MB, max {max(mb for _, mb in memory):.0f} MB (samples every 10 s: "
        f"{' '.join(f'{mb:.0f}' for _, mb in memory)})")
    say(f"/health during the run: {sorted(set(health))}; after: {final_health}")
    outcomes = [line for line in metrics.splitlines() if line.startswith("specstand:requests_total")]
    say("server-side outcomes: " + "; ".join(line.split("outcome=")[1] for line in outcomes))
    for problem in tally.problems:
        say(f"problem: {problem}")
    lost = tally.counts.get("good, DIFFERENT", 0) + tally.counts.get("good failed", 0) + tally.counts.get(
        "client error", 0) + tally.counts.get("bad answered wrongly", 0)
    say(f"verdict: {'PASS' if lost == 0 and final_health == 200 else 'FAIL'} ({lost} lost, corrupted or "
        "wrongly answered requests)")
    say.write(args.out)


if __name__ == "__main__":
    main()
