"""How the stand judges answers: broken JSON (a fence allowed, a schema checked) and broken tool calls."""

from specstand.bench.answers import answer_key, json_is_broken, tool_call_is_broken
from specstand.bench.replay import CallRecord

SCHEMA = {"type": "object", "required": ["name"]}


def test_broken_json_rules():
    assert not json_is_broken('{"name": "x"}', SCHEMA)
    assert not json_is_broken('```json\n{"name": "x"}\n```', SCHEMA)
    assert json_is_broken('{"name": "x"', None)
    assert json_is_broken('{"other": 1}', SCHEMA)
    assert json_is_broken("Sure! Here it is", None)
    # what a strict parser refuses, and what Python cannot read (each raised out of the report: no report)
    for text in ('{"x": NaN}', '{"x": -Infinity}', '{"x": 1e999}', "[" * 3000, '{"id": ' + "7" * 5000 + "}"):
        assert json_is_broken(text, None), text[:20]


def test_a_tool_call_is_broken_unless_it_names_an_offered_tool_with_object_arguments():
    offered = frozenset({"search"})
    assert not tool_call_is_broken({"name": "search", "arguments": '{"q": "x"}'}, offered)
    assert tool_call_is_broken({"name": "other", "arguments": '{"q": "x"}'}, offered)
    assert tool_call_is_broken({"name": "search", "arguments": '["x"]'}, offered)
    assert tool_call_is_broken({"name": "search", "arguments": '{"q": '}, offered)
    assert tool_call_is_broken({"name": "search", "arguments": {"q": "x"}}, offered)
    assert tool_call_is_broken({"name": "search", "arguments": '{"q": NaN}'}, offered)
    assert tool_call_is_broken({"name": "search", "arguments": "[" * 3000}, offered)
    calls = [{"name": "search", "arguments": "[" * 3000}]
    assert answer_key(CallRecord("t", "a", "s", 0.0, 1.0, tool_calls=calls)) == ("", (("search", "[" * 3000),))
