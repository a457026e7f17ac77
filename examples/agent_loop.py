"""A two-tool agent on the official `openai` client, against `specstand serve` as it would run against vLLM.

The loop: send the conversation and the tools; if the answer holds tool_calls, run them here, append their
results, ask again; stop at an answer without calls. Each step is printed. After the results a short user
line asks for the answer (NUDGE): the 0.5B preset otherwise calls the same tools again; `--no-nudge` leaves
it out for a model that answers on its own.

    specstand serve qwen2.5-coder-0.5b --method suffix --enable-auto-tool-choice --tool-call-parser json \\
        --api-key secret --port 8000
    python examples/agent_loop.py --base-url http://127.0.0.1:8000/v1 --api-key secret

`--compare METHOD,METHOD` starts one server per method itself (a free port each, one after the other), runs
the same conversation on each and says whether the steps are identical: speculation must not change them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
from openai import OpenAI

QUESTION = "What is the weather in Lisbon right now, and how much is 250 US dollars in euros?"
SYSTEM = "You are a travel assistant. Use the tools for facts; answer in one or two sentences."
# local stand-ins for real services, so a run is repeatable
LISBON, PARIS = {"temperature_c": 21, "sky": "sunny"}, {"temperature_c": 14, "sky": "cloudy"}
WEATHER = {"lisbon": LISBON, "lisboa": LISBON, "paris": PARIS}  # the city's own spelling too
NUDGE = "Answer my question from these results, in one sentence."
EUROS_PER_UNIT = {"EUR": 1.0, "USD": 0.92, "GBP": 1.17, "JPY": 0.0061}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }},
    {"type": "function", "function": {
        "name": "convert_currency",
        "description": "Convert an amount of money from one currency to another (ISO codes such as USD, EUR).",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number"}, "from_currency": {"type": "string"}, "to_currency": {"type": "string"},
        }, "required": ["amount", "from_currency", "to_currency"]},
    }},
]


def get_weather(city: str) -> dict:
    """Current weather of a city."""
    return WEATHER.get(city.strip().lower(), {"error": f"no weather for {city}"})


def convert_currency(amount: float, from_currency: str, to_currency: str) -> dict:
    """Convert an amount of money from one currency to another (ISO codes such as USD, EUR)."""
    rates = [EUROS_PER_UNIT.get(code.strip().upper()) for code in (from_currency, to_currency)]
    if None in rates:
        return {"error": f"unknown currency in {from_currency}, {to_currency}"}
    return {"amount": round(float(amount) * rates[0] / rates[1], 2), "currency": to_currency.upper()}


FUNCTIONS: dict[str, Callable[..., dict]] = {"get_weather": get_weather, "convert_currency": convert_currency}


def run_tool(name: str, arguments: str) -> dict:
    """The tool's result, or an error the model can read (a wrong name or arguments must not end the loop)."""
    try:
        return FUNCTIONS[name](**json.loads(arguments))
    except (KeyError, TypeError, ValueError) as error:
        return {"error": f"{type(error).__name__}: {error}"}


def run_agent(client: OpenAI, max_tokens: int, max_steps: int, nudge: bool = True) -> list[str]:
    """The conversation, step by step, as the lines printed (what --compare compares)."""
    model = client.models.list().data[0].id
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"user: {QUESTION}")
    for step in range(1, max_steps + 1):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0,
                                               max_tokens=max_tokens)
        choice = reply.choices[0]
        message = choice.message
        if not message.tool_calls:
            say(f"step {step}: answer ({choice.finish_reason}): {message.content}")
            return lines
        say(f"step {step}: {len(message.tool_calls)} tool call(s) ({choice.finish_reason})"
            + (f", with text {message.content!r}" if message.content else ""))
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            say(f"  {call.function.name}({call.function.arguments}) -> {json.dumps(result)}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
        if nudge:
            say(f"user: {NUDGE}")
            messages.append({"role": "user", "content": NUDGE})
    say(f"no final answer within {max_steps} steps")
    return lines


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(model: str, method: str, api_key: str, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "specstand.cli", "serve", model, "--method", method, "--port", str(port),
               "--enable-auto-tool-choice", "--tool-call-parser", "json", "--api-key", api_key]
    print(f"$ specstand {' '.join(command[3:])}", flush=True)
    return subprocess.Popen(command)


def wait_ready(server: subprocess.Popen, url: str, timeout_s: float = 900) -> None:
    """Until /health answers 200: the model loads and the kernels may compile first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"the server was not ready within {timeout_s:g} s")


def compare(methods: list[str], model: str, api_key: str, max_tokens: int, max_steps: int, nudge: bool) -> bool:
    """The same conversation on one fresh server per method, one after the other; True if all are identical."""
    transcripts = {}
    for method in methods:
        port = free_port()
        server = start_server(model, method, api_key, port)
        try:
            wait_ready(server, f"http://127.0.0.1:{port}")
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key)
            print(f"--- method {method}", flush=True)
            transcripts[method] = run_agent(client, max_tokens, max_steps, nudge)
        finally:
            server.terminate()
            server.wait(timeout=60)
    first, *others = methods
    same = all(transcripts[m] == transcripts[first] for m in others)
    verdict = "identical" if same else "DIFFERENT"
    print(f"=== {', '.join(methods)}: every step {verdict}", flush=True)
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="a running server's /v1 URL")
    parser.add_argument("--api-key", default=os.environ.get("SPECSTAND_API_KEY", "none"),
                        help="the server's --api-key (default: $SPECSTAND_API_KEY)")
    parser.add_argument("--max-tokens", type=int, default=96, help="answer tokens per step")
    parser.add_argument("--max-steps", type=int, default=4, help="requests before giving up")
    parser.add_argument("--no-nudge", dest="nudge", action="store_false",
                        help="no user line asking for the answer after the tool results")
    parser.add_argument("--compare", default=None, metavar="METHOD,METHOD",
                        help="start a server per method (e.g. none,suffix) and compare their conversations")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="--compare: the model the servers load")
    args = parser.parse_args()
    if args.compare:
        methods = [m for m in args.compare.split(",") if m]
        return 0 if compare(methods, args.model, args.api_key, args.max_tokens, args.max_steps,
                                args.nudge) else 1
    run_agent(OpenAI(base_url=args.base_url, api_key=args.api_key), args.max_tokens, args.max_steps, args.nudge)
    return 0


if __name__ == "__main__":
    sys.exit(main())
