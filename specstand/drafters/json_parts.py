"""The parts json_reader.py's `AnswerReader` reads an answer with, and what the prompt hints where the schema
leaves a choice: the structure a request fixes (`answer_structure`), a schema's values and how text fits them,
the containers and strings open in the JSON (frames), the answer's whitespace, date and time layouts, and what
the prompt speaks of (`mentions`, `ranked_choice`) and holds (`copied_value`).
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Self

_ARGUMENT_KEYS = ("arguments", "parameters")  # what tool-call objects name a function's arguments


@dataclass(frozen=True)
class AnswerStructure:
    """What a request fixes about its answer: the offered functions (name -> JSON Schema of their
    parameters) and the schema a response format asks for (None: no response format)."""

    functions: dict[str, dict]
    response_schema: dict | None = None

    def root(self) -> tuple[dict, dict[str, dict] | None]:
        """The schema of the answer's JSON object, and the functions whose arguments it carries (a call)."""
        if self.functions:
            call = {"type": "object", "required": ["name", "arguments"],
                    "properties": {"name": {"type": "string", "enum": list(self.functions)},
                                   "arguments": {"type": "object"}}}
            return call, self.functions
        return self.response_schema or {"type": "object"}, None


def answer_structure(tools: list | None, response_format: dict | None,
                     prompt_text: str = "") -> AnswerStructure | None:
    """The structure of a request's answer: from its `tools` (OpenAI form), else a tools list written in
    its prompt (older workloads pasted it into the system prompt), and its `response_format`."""
    functions = functions_of(tools) if tools else functions_of(tools_in_text(prompt_text))
    response_schema = _response_schema(response_format)
    if not functions and response_schema is None:
        return None
    return AnswerStructure(functions, response_schema)


def functions_of(tools: list | None) -> dict[str, dict]:
    """Function name -> parameters schema, from OpenAI tools or bare {name, parameters} entries."""
    functions: dict[str, dict] = {}
    for tool in tools or []:
        if not isinstance(tool, dict):
            continue
        function = tool.get("function", tool)
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            functions[function["name"]] = _parameters_schema(function.get("parameters"))
    return functions


def _parameters_schema(parameters: object) -> dict:
    """A JSON Schema object; the importers' older summary {param: {"type", "required": bool}} is turned into
    one (its parameter order kept)."""
    if not isinstance(parameters, dict):
        return {"type": "object"}
    if parameters.get("type") == "object" or "properties" in parameters:
        return parameters
    properties = {name: {k: v for k, v in spec.items() if k != "required"}
                  for name, spec in parameters.items() if isinstance(spec, dict)}
    required = [name for name, spec in parameters.items() if isinstance(spec, dict) and spec.get("required") is True]
    return {"type": "object", "properties": properties, "required": required}


def tools_in_text(text: str) -> list[dict] | None:
    """A tools list written in a prompt: the first JSON array of objects that have a name (or a function
    with one), else the one-object-a-line list of a chat template's <tools> block."""
    decoder = json.JSONDecoder()
    for start in _occurrences(text, "[{"):
        try:
            value, _ = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):  # not JSON, nested past Python's stack, or a number too long to read
            continue
        if isinstance(value, list) and functions_of(value):
            return value
    begin, end = text.find("<tools>"), text.find("</tools>")
    if 0 <= begin < end:
        tools = []
        for line in text[begin + len("<tools>") : end].splitlines():
            try:
                tools.append(json.loads(line))
            except (ValueError, RecursionError):
                continue
        return tools or None
    return None


def _occurrences(text: str, needle: str) -> Iterator[int]:
    at = text.find(needle)
    while at >= 0:
        yield at
        at = text.find(needle, at + 1)


def _response_schema(response_format: dict | None) -> dict | None:
    kind = (response_format or {}).get("type")
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        return schema if isinstance(schema, dict) else {"type": "object"}
    return None


def _enum(schema: dict) -> list | None:
    if "const" in schema:
        return [schema["const"]]
    values = schema.get("enum")
    return values if isinstance(values, list) and values else None


def _string_values(schema: dict) -> list[str]:
    """The schema's enum (or const) values that are strings."""
    return [v for v in _enum(schema) or [] if isinstance(v, str)]


FITS, QUOTED, BREAKS = 0, 1, 2  # how text keeps to a schema (AnswerReader.fit), best first
_TYPE_OPENERS = {"string": '"', "object": "{", "array": "[", "boolean": "tf", "null": "n",
                 "number": "-0123456789", "integer": "-0123456789"}
_TYPE_NAMES = frozenset(("string", "number", "integer", "boolean", "object", "array", "null"))


_WORD_CHARS = frozenset("-_.:/$@+#%&=")  # what a copied word-like value (a date, an id, a time) may hold
_NUMBER_CHARS = frozenset("0123456789.eE+-")


def copied_value(source: str, kind: str, written: str, longest: int = 60,
                 layout: str | None = None) -> tuple[str, float] | None:
    """The rest of a value whose first characters `written` were copied from `source` (the prompt: the user's
    words, earlier tool results), where `source` holds them at the start of a word: the continuation most
    occurrences share, and the share of occurrences that agree. A string copied from inside quotes runs to its
    closing quote; from running text, to the end of its word (then the value's closing quote); a number to its
    last digit."""
    rests: dict[str, int] = {}
    for at in _occurrences(source, written):
        if at > 0 and (source[at - 1].isalnum() or (kind == "scalar" and source[at - 1] in _NUMBER_CHARS)):
            continue
        after = source[at + len(written) : at + len(written) + longest]
        if kind == "scalar":
            end = next((i for i, c in enumerate(after) if c not in _NUMBER_CHARS), None)
            rest = after[:end] if end is not None else None
        elif at > 0 and source[at - 1] == '"':
            end = after.find('"')
            rest = after[: end + 1] if end >= 0 else None
        else:
            end = next((i for i, c in enumerate(after) if not (c.isalnum() or c in _WORD_CHARS)), None)
            rest = after[:end].rstrip(".:") + '"' if end is not None else None
        if rest is not None and layout is not None:  # as far as it keeps to the value's layout
            rest = _laid_out_start(layout, written, rest)
        if rest is not None:
            rests[rest] = rests.get(rest, 0) + 1
    if not rests:
        return None
    best = max(rests, key=lambda rest: rests[rest])  # the first of the most frequent: dicts keep their order
    return (best, rests[best] / sum(rests.values())) if best not in ("", '"') else None


_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")


def words(text: str) -> list[str]:
    """A text's words as names are read: snake_case, kebab-case and camelCase split, lower case, a plural's s
    dropped ("Vehicle_Supplier_Ratings": vehicle, supplier, rating)."""
    found = (word.lower() for word in _WORD.findall(text))
    return [word[:-1] if len(word) > 3 and word.endswith("s") else word for word in found if len(word) > 1]


def mentions(prompt: str, tools: list | None, names: list[str]) -> tuple[Counter, Counter]:
    """How often each word occurs in the prompt outside the tool definitions and outside the names of calls
    written earlier in it (what the user and the tool results speak of), and how often each of `names` was
    called earlier (written beyond its definition)."""
    counts = Counter(words(prompt))
    definitions = json.dumps(tools or [], ensure_ascii=False)
    counts.subtract(words(definitions))
    called = Counter({name: prompt.count(name) - definitions.count(name) for name in names})
    for name, times in called.items():  # a call written earlier names its function: not the user's words
        counts.subtract(words(name) * max(times, 0))
    return +counts, +called  # the positive counts only


def ranked_choice(spoken: Counter, called: Counter, written: str, candidates: list[str]) -> tuple[str, float] | None:
    """What to draft of a function name (or an enum value) that several candidates begin with `written`: those
    whose own words the prompt speaks of most (`spoken`, see `mentions`), one fewer for one called earlier
    (an agent's next call is mostly to another function), are kept; the rest of one kept, to its closing
    quote, else the start they share. And its share of the kept candidates' words. None where that is no
    longer than what every candidate writes next. Words every candidate has tell none apart."""
    matching = [c for c in candidates if c.startswith(written)]
    if len(matching) < 2:
        return None
    own = {c: set(words(c)) for c in matching}
    shared = set.intersection(*own.values())
    hits = {c: sum(1 for word in own[c] - shared if spoken[word] > 0) for c in matching}
    score = {c: hits[c] - (1 if called[c] > 0 else 0) for c in matching}
    best = max(score.values())
    kept = [c for c in matching if score[c] == best]
    if len(kept) == len(matching):
        return None
    share = sum(hits[c] for c in kept) / max(1, sum(hits.values()))
    if len(kept) == 1:
        return kept[0][len(written) :] + '"', share
    start = _completion(written, kept)
    return (start, share) if start != _completion(written, matching) else None


# a date or time layout a string value's description spells ("Format: YYYY-MM-DD", "HH:MM"): its letters are
# digits, the rest separators the answer writes as they are
_LAYOUT_FIELD = r"(?:YYYY|yyyy|MM|DD|dd|HH|hh|mm|SS|ss)"
_LAYOUT = re.compile(rf"(?<![A-Za-z]){_LAYOUT_FIELD}(?:[-/:.T]{_LAYOUT_FIELD})+(?![A-Za-z])")
_LAYOUT_DIGITS = frozenset("YyMDdHhmSs")
_FORMAT_LAYOUTS = {"date": "YYYY-MM-DD"}  # JSON Schema's `format` values that fix one layout
DIGITS = tuple("0123456789")


def value_layout(schema: dict) -> str | None:
    """The layout of a string value's digits and separators where its schema gives exactly one: JSON Schema's
    `format: date`, or the one layout its description spells."""
    named = schema.get("format")
    if isinstance(named, str) and named in _FORMAT_LAYOUTS:
        return _FORMAT_LAYOUTS[named]
    description = schema.get("description")
    return _spelled_layout(description) if isinstance(description, str) else None


@functools.lru_cache(maxsize=1024)
def _spelled_layout(description: str) -> str | None:
    """The one layout a description spells (read once: the fit of every guessed character asks)."""
    found = set(_LAYOUT.findall(description))
    return found.pop() if len(found) == 1 else None


def follows_layout(layout: str, text: str) -> bool:
    """Whether `text` is the start of a value laid out as `layout` (a digit where it has a letter)."""
    return len(text) <= len(layout) and all(
        char.isdigit() if slot in _LAYOUT_DIGITS else char == slot for char, slot in zip(text, layout, strict=False))


def _laid_out_start(layout: str, written: str, rest: str) -> str:
    """The longest start of `rest` after `written` that keeps to `layout` (with the closing quote where the
    value is complete there)."""
    kept = ""
    for char in rest:
        if char == '"' and len(written) + len(kept) == len(layout):
            return kept + char
        if not follows_layout(layout, written + kept + char):
            break
        kept += char
    return kept


def layout_rest(layout: str, written: str) -> str | None:
    """What `layout` puts next after the value's `written` start: its separators up to the next digit, or the
    closing quote once every digit is written. None where a digit comes next or `written` does not follow it."""
    if not follows_layout(layout, written):
        return None
    if len(written) == len(layout):
        return '"'
    ahead = layout[len(written) :]
    separators = ahead[: next((i for i, slot in enumerate(ahead) if slot in _LAYOUT_DIGITS), len(ahead))]
    return separators or None


def _opening_fit(schema: dict, char: str) -> int:
    """How a value of `schema` starting with `char` fits (any start fits where its type is not one of JSON's)."""
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    openers = [_TYPE_OPENERS.get(k) if isinstance(k, str) else None for k in kinds]
    if not kinds or None in openers or any(char in opener for opener in openers):
        return FITS
    return QUOTED if char == '"' else BREAKS


def _string_fit(frame: _String, parent: _Frame, char: str) -> int:
    """How `char` fits inside the string `frame` (a key of `parent`, or a value)."""
    if frame.escaped or char == "\\":
        return FITS
    if frame.is_key:
        assert isinstance(parent, _Object)
        candidates = parent.unwritten()
    else:
        candidates = _string_values(frame.schema)
        if not candidates and char == '"' and frame.text in _TYPE_NAMES:
            return BREAKS
        layout = value_layout(frame.schema)
        if layout is not None and follows_layout(layout, frame.text) and char != '"':  # an answer may end it early
            return FITS if follows_layout(layout, frame.text + char) else BREAKS
    if not candidates:
        return FITS
    if char == '"':
        return FITS if frame.text in candidates else BREAKS
    return FITS if any(c.startswith(frame.text + char) for c in candidates) else BREAKS


def _completion(prefix: str, candidates: list[str]) -> str:
    """What every candidate that starts with `prefix` writes next: the rest and its closing quote where one
    candidate is left, else their common continuation."""
    matching = [c for c in candidates if c.startswith(prefix)]
    if not matching:
        return ""
    if len(matching) == 1:
        return matching[0][len(prefix) :] + '"'
    shortest, longest = min(matching), max(matching)
    return os.path.commonprefix([shortest, longest])[len(prefix) :]


NEWLINE = "\n"  # a style's gap that breaks the line, then indents to the depth of the container it is in


@dataclass
class _Style:
    """Whitespace after ':' and ',', after '{'/'[' and before '}'/']': json.dumps' until the answer shows its
    own. A gap that breaks the line (json.dumps with indent=N) goes on with one indentation unit per level,
    the unit as the answer first wrote it (None: not known yet, or the gap varies)."""

    colon: str | None = " "
    comma: str | None = " "
    open: str | None = ""
    close: str | None = ""
    indent: str | None = None  # one level's indentation, once a line break showed it
    learned: frozenset[str] = frozenset()

    def learn(self, kind: str, gap: str, depth: int) -> None:
        """The answer wrote `gap` as a `kind` gap inside a container `depth` levels deep (1: the root's)."""
        if kind in self.learned:
            return
        self.learned = self.learned | {kind}
        if "\n" not in gap:
            setattr(self, kind, gap)
            if kind == "colon" and "comma" not in self.learned and self.comma != NEWLINE:
                self.comma = self.colon  # json.dumps writes both with a space, or (compact) neither
            return
        if kind == "colon":
            self.colon = None
            return
        setattr(self, kind, NEWLINE)
        if kind == "open":  # an indenting json.dumps breaks the line after every ',' and before each closing too
            for other in ("comma", "close"):
                if other not in self.learned:
                    setattr(self, other, NEWLINE)
        level, line = _level(kind, depth), gap[gap.rindex("\n") + 1 :]
        if self.indent is None and level and line and len(line) % level == 0 and len(set(line)) == 1:
            self.indent = line[: len(line) // level]

    def rest(self, kind: str, gap: str, depth: int) -> str | None:
        """The whitespace still to come after `gap` was written, or None where unknown."""
        expected = getattr(self, kind)
        if expected == NEWLINE:
            level = _level(kind, depth)
            if level and self.indent is None:
                return None
            expected = "\n" + (self.indent or "") * level
        if expected is None or not expected.startswith(gap):
            return None
        return expected[len(gap) :]


def _level(kind: str, depth: int) -> int:
    """The indentation level of a `kind` gap in a container `depth` levels deep: a closing goes back one."""
    return depth - 1 if kind == "close" else depth


@dataclass
class _Object:
    schema: dict
    functions: dict[str, dict] | None = None  # a tool call's object: its arguments follow the named function
    keys: list[str] = field(default_factory=list)
    strings: dict[str, str] = field(default_factory=dict)  # string values written so far, by key
    phase: str = "open"  # open (after '{'), key (after ','), colon, value (after ':'), next (after a value)
    gap: str = ""  # whitespace since the last structural character

    def properties(self) -> dict:
        properties = self.schema.get("properties")
        return properties if isinstance(properties, dict) else {}

    def unwritten(self) -> list[str]:
        return [key for key in self.properties() if key not in self.keys]

    def next_in_order(self, prefix: str) -> str | None:
        """The first unwritten property after the last key written, in the schema's order, that begins with
        `prefix`: models write a function's optional arguments in the order it lists them."""
        order = list(self.properties())
        last = max((order.index(key) for key in self.keys if key in order), default=-1)
        return next((key for key in order[last + 1 :] if key not in self.keys and key.startswith(prefix)), None)

    def next_required(self) -> str | None:
        required = self.schema.get("required")
        if not isinstance(required, list):  # draft 3 put `"required": true` on the property itself
            return None
        return next((key for key in self.unwritten() if key in required), None)

    def value_schema(self) -> dict:
        key = self.keys[-1]
        if self.functions is not None and key in _ARGUMENT_KEYS:
            return self.functions.get(self.strings.get("name", ""), {"type": "object"})
        schema = self.properties().get(key, {})
        return schema if isinstance(schema, dict) else {}

    def copy(self) -> _Object:
        return replace(self, keys=list(self.keys), strings=dict(self.strings))


class _FlatFrame:
    """A frame whose fields are never changed in place: a shallow copy is a full one."""

    def copy(self) -> Self:
        return replace(self)


@dataclass
class _Array(_FlatFrame):
    schema: dict
    count: int = 0
    phase: str = "open"  # open (after '['), value (after ','), next (after a value)
    gap: str = ""

    def items(self) -> dict:
        items = self.schema.get("items")
        return items if isinstance(items, dict) else {}


@dataclass
class _String(_FlatFrame):
    schema: dict
    is_key: bool
    text: str = ""
    escaped: bool = False


@dataclass
class _Scalar(_FlatFrame):
    """A number or keyword being written."""

    schema: dict
    text: str


_Frame = _Object | _Array | _String | _Scalar
