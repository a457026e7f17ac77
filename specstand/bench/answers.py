"""How the stand judges an answer: broken JSON, a broken tool call, and what two answers must share to be
identical. An answer with tool calls is judged by its calls: broken if one's arguments are not a JSON object
or it names a tool the call did not offer; identical if its text and calls (names, arguments as JSON values;
ids are random) are the baseline's. An answer without calls to a call that required one (tool_choice
"required" or a named function) is broken too: the agent has nothing to run.
"""

from __future__ import annotations

import contextlib
import json
import re

import jsonschema

from specstand.bench.replay import CallRecord
from specstand.server.tool_calls import STRICT_JSON, offered_tool_names
from specstand.workloads import Call

_FENCE = re.compile(r"^\s*```[a-zA-Z]*\s*\n?(.*?)\n?```\s*$", re.DOTALL)


def json_is_broken(text: str, schema: dict | None) -> bool:
    """An expected-JSON answer is broken if it does not parse (a surrounding ``` fence is allowed) or
    does not validate against its schema."""
    match = _FENCE.match(text)
    try:
        value = STRICT_JSON.decode(match.group(1) if match else text)  # as the server reads a tool call
    except (ValueError, RecursionError):  # not JSON, nested past Python's stack, or a number too long to read
        return True
    if schema:
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError:
            return True
    return False


def tool_call_is_broken(tool_call: dict, offered: frozenset[str]) -> bool:
    if tool_call.get("name") not in offered or not isinstance(tool_call.get("arguments"), str):
        return True
    try:
        return not isinstance(STRICT_JSON.decode(tool_call["arguments"]), dict)
    except (ValueError, RecursionError):
        return True


def tool_call_required(call: Call) -> bool:
    """The call offered tools and required the answer to call one: tool_choice "required" or a named function
    (OpenAI's {"type": "function", "function": {"name": ...}})."""
    choice = call.tool_choice
    named = isinstance(choice, dict) and choice.get("type") == "function"  # not {"type": "allowed_tools", ...}
    return bool(call.tools) and (choice == "required" or named)


def answer_is_judged(record: CallRecord, call: Call) -> bool:
    """Whether the answer must be JSON: expected JSON, a required tool call, or tool calls it made."""
    return call.expect_json or tool_call_required(call) or bool(record.tool_calls)


def answer_is_broken(record: CallRecord, call: Call) -> bool:
    """An answer's tool calls if it has any; none where one was required is broken; else its text as
    expected JSON."""
    if record.tool_calls:
        offered = offered_tool_names(call.tools)
        return any(tool_call_is_broken(tool_call, offered) for tool_call in record.tool_calls)
    if tool_call_required(call):
        return True
    return json_is_broken(record.text, call.json_schema)


def answer_key(record: CallRecord) -> tuple:
    """What two answers must share to be identical: the text and the calls (arguments compared as JSON)."""
    calls = []
    for tool_call in record.tool_calls or []:
        arguments = tool_call.get("arguments")
        with contextlib.suppress(TypeError, ValueError, RecursionError):  # unparsable: compared as written
            arguments = json.dumps(json.loads(arguments), sort_keys=True)
        calls.append((tool_call.get("name"), arguments))
    return record.text, tuple(calls)
