import json

import pytest

from specstand.workloads import Call, Turn, WorkloadError, load_workload, save_workload


def _write(tmp_path, *turns):
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(t if isinstance(t, str) else json.dumps(t) for t in turns) + "\n")
    return path


GOOD = {"turn_id": "t1", "calls": [
    {"id": "a", "messages": [{"role": "user", "content": "hi"}], "expect_json": True,
     "json_schema": {"type": "object"}},
    {"id": "b", "prompt": "raw", "depends_on": ["a"], "delay_ms": 120, "max_tokens": 8},
]}


def test_round_trip(tmp_path):
    turns = load_workload(_write(tmp_path, GOOD))
    assert turns[0].calls[1].depends_on == ["a"] and turns[0].calls[1].delay_ms == 120
    out = tmp_path / "copy.jsonl"
    save_workload(turns, out)
    assert load_workload(out) == turns


def test_saving_into_a_folder_that_does_not_exist_yet_creates_it(tmp_path):
    """`workload import --out new/folder/w.jsonl` failed on the missing folder (its temporary file's)."""
    turns = load_workload(_write(tmp_path, GOOD))
    out = tmp_path / "new" / "folder" / "w.jsonl"
    save_workload(turns, out)
    assert load_workload(out) == turns and [p.name for p in out.parent.iterdir()] == ["w.jsonl"]


@pytest.mark.parametrize(
    ("turn", "message"),
    [
        ("{broken", "w.jsonl:2: not valid JSON"),
        ({"turn_id": "x", "calls": []}, "w.jsonl:2: calls: [] should be non-empty"),
        ({"turn_id": "x", "calls": [{"id": "a"}]}, "w.jsonl:2: calls[0]: a call needs exactly one of"),
        ({"turn_id": "x", "calls": [{"id": "a", "prompt": "p", "max_tokens": 0}]}, "calls[0].max_tokens"),
        ({"turn_id": "x", "calls": [{"id": "a", "prompt": "p", "delay_ms": "soon"}]}, "calls[0].delay_ms"),
        ({"turn_id": "x", "calls": [{"id": "a", "prompt": "p", "depends_on": ["zz"]}]},
         "calls[0].depends_on[0]: unknown call 'zz'"),
        ({"turn_id": "x", "calls": [{"id": "a", "prompt": "p", "depends_on": ["b"]},
                                    {"id": "b", "prompt": "p", "depends_on": ["a"]}]}, "dependency cycle"),
        ({"turn_id": "x", "calls": [{"id": "a", "prompt": "p", "colour": "red"}]}, "Additional properties"),
        ({"turn_id": "t1", "calls": [{"id": "a", "prompt": "p"}]}, "duplicate turn_id 't1'"),
        ({"turn_id": "x", "calls": [{"id": "a", "prompt": "p", "expect_json": True,
                                     "json_schema": {"type": "objekt"}}]}, "calls[0].json_schema: not a JSON schema"),
        # a $ref the report would meet only when judging an answer (a traceback, and no report)
        ({"turn_id": "x", "calls": [{"id": "a", "prompt": "p", "expect_json": True, "json_schema": {
            "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}]},
         "calls[0].json_schema: $ref '#/definitions/missing' points nowhere"),
        # Python's json reads these; an infinite delay hung the replay
        ('{"turn_id": "x", "calls": [{"id": "a", "prompt": "p", "delay_ms": Infinity}]}', "w.jsonl:2: not valid JSON"),
        ('{"turn_id": "x", "calls": [{"id": "a", "prompt": "p", "delay_ms": NaN}]}', "w.jsonl:2: not valid JSON"),
        ('{"turn_id": "x", "calls": [{"id": "a", "prompt": "p", "delay_ms": 1e999}]}', "w.jsonl:2: not valid JSON"),
    ],
)
def test_validation_names_line_and_field(tmp_path, turn, message):
    with pytest.raises(WorkloadError, match=".*") as caught:
        load_workload(_write(tmp_path, GOOD, turn))
    assert message in str(caught.value)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/name"}}, "$defs": {"name": {"type": "string"}}},
    # "$ref" in data (a default, an enum value) is no reference
    {"type": "object", "properties": {"link": {"type": "object", "default": {"$ref": "#/nowhere"}}}},
    {"enum": [{"$ref": "pointer"}]},
    # refs resolve against their own base: the schema's $id, a nested $id
    {"$id": "https://example.com/root.json", "$defs": {"a": {"type": "string"}},
     "properties": {"x": {"$ref": "root.json#/$defs/a"}}},
    {"$defs": {"n": {"$id": "https://example.com/n.json", "$defs": {"s": {"type": "string"}},
                     "properties": {"y": {"$ref": "#/$defs/s"}}}},
     "properties": {"x": {"$ref": "https://example.com/n.json"}}},
])
def test_a_schema_whose_refs_resolve_inside_it_is_taken(tmp_path, schema):
    turn = {"turn_id": "x", "calls": [{"id": "a", "prompt": "p", "expect_json": True, "json_schema": schema}]}
    assert load_workload(_write(tmp_path, turn))[0].calls[0].json_schema == schema


def test_nothing_is_saved_that_the_bench_would_refuse(tmp_path):
    out = tmp_path / "w.jsonl"
    for turns, message in (([Turn("t", [Call(id="a", prompt="p")]), Turn("t", [Call(id="a", prompt="q")])],
                            "duplicate turn_id 't'"),
                           ([Turn("t", [Call(id="a", prompt="")])], "exactly one of"),
                           ([Turn("t", [Call(id="a", prompt="p", delay_ms=float("inf"))])], "not JSON")):
        with pytest.raises((WorkloadError, ValueError), match=message):
            save_workload(turns, out)
        assert not out.exists()


def test_a_turn_whose_text_holds_line_separators_loads_as_saved(tmp_path):
    """A turn's text may hold U+2028, U+2029 or U+0085 as written; only "\\n" ends a line."""
    turns = [Turn("t", [Call(id="a", prompt="one\u2028two\u2029three\x85four")])]
    save_workload(turns, tmp_path / "w.jsonl")
    assert load_workload(tmp_path / "w.jsonl") == turns


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(WorkloadError, match="is not UTF-8 text"):
        load_workload(path)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(WorkloadError, match="cannot read"):
        load_workload(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(WorkloadError, match="no turns"):
        load_workload(tmp_path / "empty.jsonl")


def test_turn_to_json_omits_defaults():
    line = json.loads(Turn("t", [Call(id="a", prompt="p")]).to_json())
    assert line == {"turn_id": "t", "calls": [{"id": "a", "prompt": "p", "delay_ms": 0.0, "max_tokens": 256,
                                                "expect_json": False}]}
