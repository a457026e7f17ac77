"""Tool calls out of answers as the presets write them: whole, and streamed in every 2-piece split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specstand.server.tool_calls import ToolCall, ToolCallStream, offered_tool_names, parse_answer

FIXTURES = Path(__file__).parent / "fixtures"
# forms quoted from the presets' answers, then real answers of the Qwen preset as recorded by
# fixtures/record_tool_call_answers.py (the file says how)
CASES = [*json.loads((FIXTURES / "tool_call_answers.json").read_text()),
         *json.loads((FIXTURES / "tool_call_answers_qwen2.5-coder-0.5b.json").read_text())["cases"]]


def _calls(calls: list[ToolCall]) -> list[list]:
    return [[c.name, json.loads(c.arguments)] for c in calls]


def _streamed(case: dict, pieces: list[str]) -> tuple[list[str], list[ToolCall]]:
    stream = ToolCallStream(case["parser"], frozenset(case["tools"]))
    items = [item for piece in pieces for item in stream.feed(piece)] + stream.finish()
    return [i for i in items if isinstance(i, str)], [i for i in items if isinstance(i, ToolCall)]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_whole_answer(case):
    parsed = parse_answer(case["answer"], case["parser"], frozenset(case["tools"]))
    assert parsed.content == case["content"]
    assert _calls(parsed.tool_calls) == case["calls"]
    for call in parsed.tool_calls:
        assert call.id.startswith("call_") and len(call.id) > 10
        assert call.to_openai()["type"] == "function"
    assert len({c.id for c in parsed.tool_calls}) == len(parsed.tool_calls)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_every_split_streams_the_same_answer(case):
    text = case["answer"]
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        contents, calls = _streamed(case, pieces)
        assert ("".join(contents) or None) == case["content"], pieces
        assert _calls(calls) == case["calls"], pieces
        if case["calls"]:  # nothing of a tag, fence or object ever leaks into content
            assert not any(mark in piece for piece in contents for mark in "<`{"), (pieces, contents)


def test_content_is_held_only_while_a_call_may_be_starting():
    stream = ToolCallStream("json", frozenset({"f"}))
    assert stream.feed("Looking it up ") == ["Looking it up"]
    assert stream.feed("``") == []  # may open a fence
    assert stream.feed("`json\n{\"name\": \"f\", ") == []
    [call] = stream.feed("\"arguments\": {\"a\": 1}}\n```")
    assert (call.name, json.loads(call.arguments)) == ("f", {"a": 1})
    assert stream.feed(" then more") == [" then more"]  # the space written before the call
    assert stream.finish() == []


def test_stream_deltas_are_openai_shaped():
    header, arguments = ToolCall("call_1", "f", '{"a": 1}').stream_deltas(2)
    assert header == {"index": 2, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
    assert arguments == {"index": 2, "function": {"arguments": '{"a": 1}'}}


def test_arguments_given_as_a_json_string_are_accepted_and_junk_is_not():
    names = frozenset({"f"})
    parsed = parse_answer('{"name": "f", "arguments": "{\\"a\\": 2}"}', "json", names)
    assert _calls(parsed.tool_calls) == [["f", {"a": 2}]] and parsed.content is None
    for junk in ('{"name": "f", "arguments": "not json"}', '{"name": "f", "arguments": [1]}', '{"name": "f"}',
                 '{"name": 3, "arguments": {}}', "<tool_call>", "```json\n", "[1, 2]", "{"):
        parsed = parse_answer(junk, "json", names)
        assert parsed.tool_calls == [] and parsed.content == junk, junk


@pytest.mark.parametrize("parser", ["hermes", "json"])
def test_what_is_no_strict_json_call_stays_content(parser):
    """A name that is no string, nesting past Python's stack (a small model repeating "["), and NaN, Infinity
    or 1e999 in arguments (Python reads them; JSON.parse would not read the arguments written back): content,
    never a raise (a 500, or a stream cut mid-way) nor a call no client can parse."""
    names = frozenset({"f"})
    for text in ('{"name": ["f"], "arguments": {}}', '{"name": {"a": 1}, "arguments": {}}', "[" * 3000,
                 '{"name": "f", "arguments": {"a": ' + "[" * 3000 + "}}", '{"name": "f", "arguments": {"x": NaN}}',
                 '{"name": "f", "arguments": {"x": -Infinity}}', '{"name": "f", "arguments": {"x": 1e999}}',
                 '{"name": "f", "arguments": "{\\"x\\": NaN}"}'):
        answer = f"<tool_call>{text}</tool_call>" if parser == "hermes" else text
        parsed = parse_answer(answer, parser, names)
        assert parsed.tool_calls == [] and parsed.content == answer, text
    call = '{"name": "f", "arguments": {"x": 1e300}}'
    answer = f"<tool_call>{call}</tool_call>" if parser == "hermes" else call
    assert _calls(parse_answer(answer, parser, names).tool_calls) == [["f", {"x": 1e300}]]


def test_offered_tool_names_skips_malformed_entries():
    tools = [{"type": "function", "function": {"name": "a"}}, {"type": "function"}, "x", {"function": {"name": 3}}]
    assert offered_tool_names(tools) == {"a"}
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ToolCallStream("pythonic", frozenset())


@pytest.mark.parametrize("parser", ["hermes", "json"])
def test_random_answers_never_fail_and_stream_as_they_parse(parser):
    """Answers glued from fragments of calls, tags, fences and prose (seeded): parsing never raises, and any
    split of the stream gives the whole answer's calls and content."""
    import random

    rng = random.Random(38)
    fragments = ["<tool_call>", "</tool_call>", "```json\n", "```", "\n", " ", "{", "}", "[", "]", '"', "\\",
                 '{"name": "f", "arguments": {"a": 1}}', '{"name": "g", "arguments": {}}', '"name": "f"',
                 '"arguments": {', "<tool", "``", "prose", "é", "<", "`"]
    names = frozenset({"f"})
    for _ in range(300):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 12)))
        whole = parse_answer(text, parser, names)
        cut = rng.randint(0, len(text))
        contents, calls = _streamed({"parser": parser, "tools": sorted(names)}, [text[:cut], text[cut:]])
        assert ("".join(contents) or None) == whole.content, text
        assert _calls(calls) == _calls(whole.tool_calls), text


def test_a_long_open_object_is_read_once_as_it_streams(monkeypatch):
    from specstand.server import tool_calls

    reads = []
    original = tool_calls._JsonScan._read
    monkeypatch.setattr(tool_calls._JsonScan, "_read", lambda self, char, i: reads.append(i) or original(self, char, i))
    stream = ToolCallStream("json", frozenset({"f"}))
    text = '{"name": "f", "arguments": {"rows": [' + ", ".join(str(i) for i in range(2000)) + "]}}"
    items = [item for char in text for item in stream.feed(char)] + stream.finish()
    [call] = items
    assert json.loads(call.arguments)["rows"] == list(range(2000))
    assert sorted(reads) == list(range(len(text)))  # every character once, not once per token
