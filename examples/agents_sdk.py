"""The same two tools through an agent framework, the OpenAI Agents SDK, unchanged against `specstand serve`.

    pip install openai-agents
    specstand serve qwen2.5-coder-0.5b --method suffix --enable-auto-tool-choice --api-key secret --port 8000
    python examples/agents_sdk.py --base-url http://127.0.0.1:8000/v1 --api-key secret

The SDK drives the loop (call the model, run the tools it asks for, call it again) over the chat completions
API; the tools and the question are agent_loop.py's.
"""

from __future__ import annotations

import argparse
import os
import sys

from agent_loop import QUESTION, SYSTEM, convert_currency, get_weather
from agents import (
    Agent,
    ItemHelpers,
    MaxTurnsExceeded,
    MessageOutputItem,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunItem,
    Runner,
    ToolCallItem,
    ToolCallOutputItem,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="a running server's /v1 URL")
    parser.add_argument("--api-key", default=os.environ.get("SPECSTAND_API_KEY", "none"), help="its --api-key")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="the served model's name")
    parser.add_argument("--max-tokens", type=int, default=96, help="answer tokens per model call")
    parser.add_argument("--max-turns", type=int, default=4, help="model calls before the SDK gives up")
    args = parser.parse_args()
    set_tracing_disabled(True)  # the SDK would otherwise send its traces to OpenAI
    model = OpenAIChatCompletionsModel(model=args.model,
                                       openai_client=AsyncOpenAI(base_url=args.base_url, api_key=args.api_key))
    agent = Agent(name="travel assistant", instructions=SYSTEM, model=model,
                  tools=[function_tool(get_weather), function_tool(convert_currency)],
                  model_settings=ModelSettings(temperature=0, max_tokens=args.max_tokens))
    print(f"user: {QUESTION}")
    try:
        result = Runner.run_sync(agent, QUESTION, max_turns=args.max_turns)
    except MaxTurnsExceeded as error:  # what the run did is still worth showing
        print_items(error.run_data.new_items if error.run_data else [])
        print(f"no final output: {error}")
        return 1
    print_items(result.new_items)
    print(f"final output: {result.final_output}")
    return 0


def print_items(items: list[RunItem]) -> None:
    for item in items:
        if isinstance(item, ToolCallItem):
            print(f"  tool call {item.raw_item.name}({item.raw_item.arguments})")
        elif isinstance(item, ToolCallOutputItem):
            print(f"  tool result {item.output}")
        elif isinstance(item, MessageOutputItem):
            print(f"  message: {ItemHelpers.text_message_output(item)}")


if __name__ == "__main__":
    sys.exit(main())
