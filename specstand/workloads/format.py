"""The workload format: JSON Lines, one agent turn per line.

    {"turn_id": "cfb-12",
     "calls": [
        {"id": "step1", "stage": "Search_Hotels",
         "messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
         "depends_on": [], "delay_ms": 0, "max_tokens": 128,
         "expect_json": true, "json_schema": {"type": "object"}},
        {"id": "step2", "stage": "Get_Rooms", "prompt": "raw text prompt instead of messages",
         "depends_on": ["step1"], "delay_ms": 350, "max_tokens": 64}
     ]}

A call starts when every call in `depends_on` (ids of the same turn) has finished, plus `delay_ms` (the
pause recorded after its dependencies, e.g. tool execution). Exactly one of `messages` (OpenAI chat, tool
calls included: `content` may be null beside `tool_calls`, or a list of text parts) and `prompt` (raw
completion) is given; `tools`/`tool_choice` are sent with the messages as recorded. `expect_json` marks
answers that must parse as JSON, and validate against `json_schema` when one is given.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import jsonschema
from referencing import Registry, Resource
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

from specstand.files import write_text_atomic

if TYPE_CHECKING:
    from referencing._core import Resolver  # what Registry.resolver returns (not exported by name)

_SCHEMA_URI = "urn:specstand:json-schema"  # the name a call's schema goes by while its $refs are looked up

CALL_SCHEMA = {
    "type": "object",
    "required": ["id"],
    "additionalProperties": False,
    "properties": {
        "id": {"type": "string", "minLength": 1},
        "stage": {"type": "string"},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role"],
                "properties": {
                    "role": {"type": "string"},
                    "content": {"type": ["string", "array", "null"], "items": {"type": "object"}},
                    "tool_calls": {"type": "array", "items": {"type": "object"}},
                    "tool_call_id": {"type": "string"},
                    "name": {"type": "string"},
                },
            },
        },
        "tools": {"type": "array", "items": {"type": "object"}},
        "tool_choice": {"type": ["string", "object"]},
        "prompt": {"type": "string", "minLength": 1},
        "depends_on": {"type": "array", "items": {"type": "string"}},
        "delay_ms": {"type": "number", "minimum": 0},
        "max_tokens": {"type": "integer", "minimum": 1},
        "expect_json": {"type": "boolean"},
        "json_schema": {"type": ["object", "null"]},
        "recorded": {"type": "object"},
    },
    "oneOf": [{"required": ["messages"]}, {"required": ["prompt"]}],
}
TURN_SCHEMA = {
    "type": "object",
    "required": ["turn_id", "calls"],
    "additionalProperties": False,
    "properties": {
        "turn_id": {"type": "string", "minLength": 1},
        "calls": {"type": "array", "minItems": 1, "items": CALL_SCHEMA},
        "source": {"type": "string"},
    },
}


class WorkloadError(ValueError):
    pass


@dataclass
class Call:
    id: str
    messages: list[dict] | None = None
    prompt: str | None = None
    stage: str = ""
    depends_on: list[str] = field(default_factory=list)
    delay_ms: float = 0.0
    max_tokens: int = 256
    expect_json: bool = False
    json_schema: dict | None = None
    tools: list[dict] | None = None  # offered to the model with `messages`
    tool_choice: str | dict | None = None
    recorded: dict | None = None  # what the recorder saw (response text, timings); not replayed


@dataclass
class Turn:
    turn_id: str
    calls: list[Call]
    source: str = ""

    def to_json(self) -> str:
        calls = [{k: v for k, v in asdict(c).items() if v is not None and v != [] and v != ""} for c in self.calls]
        out = {"turn_id": self.turn_id, "calls": calls}
        if self.source:
            out["source"] = self.source
        return json.dumps(out, ensure_ascii=False)


def parse_turn(data: object, where: str) -> Turn:
    try:
        jsonschema.validate(data, TURN_SCHEMA)
    except jsonschema.ValidationError as error:
        raise WorkloadError(f"{where}: {_field(error)}: {_reason(error)}") from None
    turn = Turn(data["turn_id"], [Call(**c) for c in data["calls"]], data.get("source", ""))
    _check_graph(turn, where)
    _check_json_schemas(turn, where)
    return turn


def _field(error: jsonschema.ValidationError) -> str:
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    return path.lstrip(".") or "turn"


def _reason(error: jsonschema.ValidationError) -> str:
    if error.validator == "oneOf":
        return "a call needs exactly one of 'messages' and 'prompt'"
    return error.message


def _check_json_schemas(turn: Turn, where: str) -> None:
    """An answer is judged against its call's schema (broken JSON), so the schema itself must be one, every
    `$ref` in it resolving inside it (the bench reaches no network)."""
    for i, call in enumerate(turn.calls):
        if call.json_schema:
            try:
                jsonschema.validators.validator_for(call.json_schema).check_schema(call.json_schema)
            except jsonschema.SchemaError as error:
                raise WorkloadError(f"{where}: calls[{i}].json_schema: not a JSON schema ({error.message})") from None
            ref = _unresolved_ref(call.json_schema)
            if ref is not None:
                raise WorkloadError(f"{where}: calls[{i}].json_schema: $ref {ref!r} points nowhere in the schema")


def _unresolved_ref(schema: dict) -> str | None:
    """The first `$ref` of `schema` that does not resolve inside it. Only schema positions are read (a
    "$ref" inside `default` or `enum` is data), each against its own base (`$id`s, nested ones too)."""
    root = Resource.from_contents(schema, default_specification=DRAFT202012)
    base = root.id() or _SCHEMA_URI
    resolver = Registry().with_resource(base, root).resolver(base)
    return _first_unresolved(resolver, root)


def _first_unresolved(resolver: Resolver, resource: Resource) -> str | None:
    contents = resource.contents
    ref = contents.get("$ref") if isinstance(contents, dict) else None
    if isinstance(ref, str):
        try:
            resolver.lookup(ref)
        except Unresolvable:
            return ref
    for sub in resource.subresources():
        found = _first_unresolved(resolver.in_subresource(sub), sub)
        if found is not None:
            return found
    return None


def _finite_number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is past a double's range")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _parse_line(line: str, where: str) -> Turn:
    """A workload line's turn. Its JSON is read strictly: Python reads NaN, Infinity and 1e999, and an infinite
    delay_ms would hang the replay."""
    try:
        data = json.loads(line, parse_constant=_no_constant, parse_float=_finite_number)
    except json.JSONDecodeError as error:
        raise WorkloadError(f"{where}: not valid JSON ({error.msg})") from None
    except (ValueError, RecursionError) as error:
        raise WorkloadError(f"{where}: not valid JSON ({error})") from None
    return parse_turn(data, where)


def checked_line(turn: Turn, where: str) -> str:
    """The turn's workload line, read back as load_workload reads it: a WorkloadError for a turn it would refuse,
    so that nothing is written that the bench cannot load."""
    line = turn.to_json()
    _parse_line(line, where)
    return line


def _check_graph(turn: Turn, where: str) -> None:
    ids = [c.id for c in turn.calls]
    if len(set(ids)) != len(ids):
        raise WorkloadError(f"{where}: calls: duplicate call id in turn {turn.turn_id!r}")
    known = set(ids)
    for i, call in enumerate(turn.calls):
        for j, dep in enumerate(call.depends_on):
            if dep not in known:
                raise WorkloadError(f"{where}: calls[{i}].depends_on[{j}]: unknown call {dep!r}")
    # a dependency cycle would deadlock the replay
    done: set[str] = set()
    pending = {c.id: set(c.depends_on) for c in turn.calls}
    while pending:
        ready = [cid for cid, deps in pending.items() if deps <= done]
        if not ready:
            raise WorkloadError(f"{where}: calls: dependency cycle among {sorted(pending)}")
        for cid in ready:
            done.add(cid)
            del pending[cid]


def load_workload(path: str | Path) -> list[Turn]:
    path = Path(path)
    try:
        # "\n" only: splitlines() also breaks at U+2028 and the like, which a turn's text may hold as written
        lines = path.read_text(encoding="utf-8").split("\n")
    except OSError as error:
        raise WorkloadError(f"cannot read workload {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise WorkloadError(f"workload {path} is not UTF-8 text") from None
    turns = [_parse_line(line, f"{path}:{number}") for number, line in enumerate(lines, start=1) if line.strip()]
    if not turns:
        raise WorkloadError(f"workload {path} holds no turns")
    _check_unique_ids(turns, str(path))
    return turns


def _check_unique_ids(turns: list[Turn], where: str) -> None:
    seen: set[str] = set()
    for turn in turns:
        if turn.turn_id in seen:
            raise WorkloadError(f"{where}: duplicate turn_id {turn.turn_id!r}")
        seen.add(turn.turn_id)


def save_workload(turns: list[Turn], path: str | Path) -> None:
    """Write atomically: a crash never leaves a half-written workload under the final name. Each turn is first
    read back as load_workload will read it, so nothing is written that the bench would refuse."""
    path = Path(path)
    lines = [checked_line(turn, f"{path}: turn {number}") for number, turn in enumerate(turns, start=1)]
    _check_unique_ids(turns, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(line + "\n" for line in lines))
