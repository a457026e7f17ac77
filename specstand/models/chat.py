"""Chat messages through a model's chat template, tool conversations included on every model.

A template that knows tools (its source mentions `tools` or `tool_calls`) gets the messages and `tools` as
they are, except that a call's arguments, which OpenAI sends as JSON text, go in as the object they spell (as
vLLM passes them: Qwen's template writes them with `tojson`, and a string there teaches the model to write its
next calls' arguments as escaped strings). One that does not (SmolLM2's) or that fails on them gets the
conversation in this text form, which any template that renders system/user/assistant turns can lay out:

- the offered tools: appended to the first system message (one is added if there is none) as
  "You can call these tools. To call one, answer with <tool_call>{"name": ..., "arguments": {...}}</tool_call>."
  and one JSON line per tool;
- an assistant turn's calls: its content followed by one `<tool_call>{"name", "arguments"}</tool_call>` line
  per call;
- tool results: a user turn `<tool_response>RESULT</tool_response>`, one line per result, consecutive results
  in one turn.

Answers in that form are what the server's `hermes` and `json` tool-call parsers read back.
"""

from __future__ import annotations

import contextlib
import json

TOOLS_PREAMBLE = ("You can call these tools. To call one, answer with "
                  '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.\nTools:')


def template_knows_tools(template: object) -> bool:
    """Whether a chat template (text, or named templates) lays out tools and tool calls itself."""
    source = "\n".join(template.values()) if isinstance(template, dict) else str(template or "")
    return "tools" in source or "tool_calls" in source


def uses_tools(messages: list[dict], tools: list[dict] | None) -> bool:
    return bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The prompt text for `messages` (+ the generation prompt), tools offered as the template can."""
    if not uses_tools(messages, tools):
        return _apply(tokenizer, messages, None)
    if template_knows_tools(tokenizer.chat_template):
        try:
            return _apply(tokenizer, [_with_argument_objects(m) for m in messages], tools)
        except Exception:  # noqa: BLE001 - the text form below renders on any template
            pass
    return _apply(tokenizer, tools_as_text(messages, tools), None)


def _apply(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)


def tools_as_text(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation with tools, calls and results written as text (the form in the module's doc)."""
    out: list[dict] = []
    results_turn = False  # the last turn written holds tool results
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "tool":
            result = f"<tool_response>{content}</tool_response>"
            if results_turn:
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
            results_turn = True
            continue
        results_turn = False
        calls = [_call_text(call) for call in message.get("tool_calls") or []]
        text = "\n".join(([content] if content else []) + calls)
        out.append({"role": role, "content": text, **({"name": message["name"]} if message.get("name") else {})})
    if tools:
        block = "\n".join([TOOLS_PREAMBLE, *(json.dumps(t, ensure_ascii=False) for t in tools)])
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _call_text(call: dict) -> str:
    function = call.get("function") or {}
    return "<tool_call>" + json.dumps({"name": function.get("name"), "arguments": _arguments(function)},
                                      ensure_ascii=False) + "</tool_call>"


def _arguments(function: dict) -> object:
    """A call's arguments: OpenAI sends them as JSON text, read back as the object they spell (text that is not
    JSON is kept as it is)."""
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(arguments)
    return arguments


def _with_argument_objects(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = [{**call, "function": {**(call.get("function") or {}), "arguments": _arguments(call.get("function") or {})}}
             for call in message["tool_calls"]]
    return {**message, "tool_calls": calls}
