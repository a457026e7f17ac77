"""How the stand judges answers: broken JSON (a fence allowed, a schema checked) and broken tool calls."""

from specstand.bench.answers import json_is_broken, tool_call_is_broken

SCHEMA = {"type": "object", "required": ["name"]}


def test_broken_json_rules():
    assert not json_is_broken('{"name": "x"}', SCHEMA)
    assert not json_is_broken('```json\n{"name": "x"}\n```', SCHEMA)
    assert json_is_broken('{"name": "x"', None)
    assert json_is_broken('{"other": 1}', SCHEMA)
    assert json_is_broken("Sure! Here it is", None)


def test_a_tool_call_is_broken_unless_it_names_an_offered_tool_with_object_arguments():
    offered = frozenset({"search"})
    assert not tool_call_is_broken({"name": "search", "arguments": '{"q": "x"}'}, offered)
    assert tool_call_is_broken({"name": "other", "arguments": '{"q": "x"}'}, offered)
    assert tool_call_is_broken({"name": "search", "arguments": '["x"]'}, offered)
    assert tool_call_is_broken({"name": "search", "arguments": '{"q": '}, offered)
    assert tool_call_is_broken({"name": "search", "arguments": {"q": "x"}}, offered)
