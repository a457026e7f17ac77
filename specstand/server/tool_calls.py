"""Tool calls out of a model's answer text, whole or as it streams (vLLM's `--tool-call-parser`).

Two parsers:

- `hermes`: calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen's and
  Hermes' chat templates ask for this form).
- `json`: an answer holding a JSON object `{"name": ..., "arguments"|"parameters": {...}}` (or a list of
  them) bare, in a ``` fenced block, or in `<tool_call>` tags. The small presets answer this way, often after
  a sentence of prose.

A candidate becomes a call only if it parses and names a tool the request offered; anything else stays
content, as written. Content is the text outside the calls, with the whitespace that separated it from a
call dropped, and the commas or semicolons written after a call (`{...}, {...}`: a list without brackets).
While streaming, text that may be the start of a call (a partial tag or fence, an open object) is held back
until it is decided, so a client never sees half a tag as content. The whole-answer parse runs the
streaming parser over the whole text, so the two can never disagree.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

PARSERS = ("hermes", "json")
TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"
FENCE = "```"
AFTER_CALL = re.compile(r"[\s,;]*")  # what separates a call from the next one: not content


def _not_json(constant: str) -> float:
    raise ValueError(f"{constant} is not JSON")


def _finite(number: str) -> float:
    value = float(number)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{number} is past a double's range")
    return value


# Python's json reads NaN, Infinity and 1e999, and would write them back as arguments no strict JSON parser reads
STRICT_JSON = json.JSONDecoder(parse_constant=_not_json, parse_float=_finite)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (what OpenAI's `function.arguments` holds)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def stream_deltas(self, index: int) -> list[dict]:
        """The `delta.tool_calls` entries OpenAI streams for one call: the header (arguments ""), then the
        arguments."""
        return [{"index": index, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": ""}},
                {"index": index, "function": {"arguments": self.arguments}}]


@dataclass(frozen=True)
class ParsedAnswer:
    content: str | None  # None when the answer is only calls
    tool_calls: list[ToolCall]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def offered_tool_names(tools: list[dict] | None) -> frozenset[str]:
    """The function names a request's `tools` offer."""
    names = set()
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.add(function["name"])
    return frozenset(names)


def parse_answer(text: str, parser: str, tool_names: frozenset[str]) -> ParsedAnswer:
    """The calls in a whole answer and the content around them."""
    stream = ToolCallStream(parser, tool_names)
    items = stream.feed(text) + stream.finish()
    content = "".join(i for i in items if isinstance(i, str))
    calls = [i for i in items if isinstance(i, ToolCall)]
    return ParsedAnswer(content or None, calls)


def _calls_in(value: object, tool_names: frozenset[str]) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call `value` spells, or None unless all of it is valid calls."""
    objects = value if isinstance(value, list) else [value]
    calls = []
    for obj in objects:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in tool_names:
            return None
        arguments = obj.get("arguments", obj.get("parameters"))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = STRICT_JSON.decode(arguments)
            except (ValueError, RecursionError):
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append((obj["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


def parse_calls(text: str, tool_names: frozenset[str]) -> list[tuple[str, str]] | None:
    """The calls a block of JSON spells: one object, a list of them, or objects one after another."""
    text = text.strip()
    values, at = [], 0
    try:
        while at < len(text):
            value, at = STRICT_JSON.raw_decode(text, at)
            values.append(value)
            while at < len(text) and text[at] in " \t\r\n,;":
                at += 1
    except (ValueError, RecursionError):  # not JSON, or nested past Python's stack: content, not calls
        return None
    calls = []
    for value in values:
        found = _calls_in(value, tool_names)
        if found is None:
            return None
        calls += found
    return calls or None


@dataclass
class _JsonScan:
    """Finds where the JSON object or array opening at `start` closes, reading each character once however
    often it is asked as the text grows (a long open object would otherwise be rescanned on every token)."""

    start: int
    at: int = -1  # the next character to read
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    end: int | None = None  # the index after the closing bracket, once seen

    def close(self, text: str) -> int | None:
        for i in range(max(self.at, self.start), len(text)):
            if self.end is not None:
                break
            self._read(text[i], i)
        self.at = len(text)
        return self.end

    def _read(self, char: str, i: int) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.end = i + 1


def _partial_suffix(text: str, literal: str) -> int:
    """Length of the longest end of `text` that is a proper start of `literal`."""
    for size in range(min(len(literal) - 1, len(text)), 0, -1):
        if literal.startswith(text[-size:]):
            return size
    return 0


@dataclass
class _Candidate:
    start: int  # where the candidate begins in the text
    end: int | None  # the index after it once closed, None while open
    body: str  # the JSON text inside it (tags and fences taken off)


@dataclass
class ToolCallStream:
    """Feed an answer's text in pieces; get back, in order, content strings and whole ToolCalls as soon as
    each is decided."""

    parser: str
    tool_names: frozenset[str]
    _text: str = ""
    _done: int = 0  # the text before this is decided and handed out
    # whitespace is held until content follows it: none is left at the ends of the content, and the text
    # on both sides of a call is joined by the whitespace written before the call
    _pending_space: str = ""
    _after_call: bool = False  # the content's leading whitespace and separators after a call are dropped
    _said: bool = False  # some content was handed out
    _bare_scan: _JsonScan | None = None  # of the bare candidate being read

    def __post_init__(self) -> None:
        if self.parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {self.parser!r} (choose from {', '.join(PARSERS)})")

    def feed(self, piece: str) -> list[str | ToolCall]:
        self._text += piece
        return self._scan(final=False)

    def finish(self) -> list[str | ToolCall]:
        """The rest, at the end of the answer: an unclosed candidate is parsed as it stands, else content."""
        items = self._scan(final=True)
        if self._pending_space and not self._after_call:
            items.append(self._pending_space)
        self._pending_space = ""
        return items

    def _scan(self, final: bool) -> list[str | ToolCall]:
        items: list[str | ToolCall] = []
        text = self._text
        while self._done < len(text):
            candidate = self._next_candidate(text, self._done)
            if candidate is None:  # no call starts in the rest, bar a possible partial opener at the end
                hold = 0 if final else self._held_tail(text[self._done:])
                self._content(text[self._done:len(text) - hold], items)
                self._done = len(text) - hold
                break
            self._content(text[self._done:candidate.start], items)
            self._done = candidate.start
            if candidate.end is None:
                if not final:
                    break
                candidate.end = len(text)  # the answer ended inside it: judge what is there
            calls = parse_calls(candidate.body, self.tool_names)
            if calls is None:
                self._content(text[candidate.start:candidate.end], items)
            else:
                if not self._said:  # whitespace before the first call is nobody's content
                    self._pending_space = ""
                self._after_call = True
                for name, arguments in calls:
                    items.append(ToolCall(new_call_id(), name, arguments))
            self._done = candidate.end
        return items

    def _content(self, text: str, items: list[str | ToolCall]) -> None:
        if self._after_call:
            text = text[AFTER_CALL.match(text).end():]
            if not text:
                return
            self._after_call = False
        stripped = text.rstrip()
        if stripped:
            items.append(self._pending_space + stripped)
            self._pending_space = ""
            self._said = True
        self._pending_space += text[len(stripped):]

    def _held_tail(self, rest: str) -> int:
        """How much of the text's end may be the start of an opener, so is not content yet."""
        openers = [TAG_OPEN] + ([FENCE] if self.parser == "json" else [])
        return max(_partial_suffix(rest, literal) for literal in openers)

    def _next_candidate(self, text: str, start: int) -> _Candidate | None:
        found = [c for c in (self._tag(text, start), *self._json_forms(text, start)) if c is not None]
        return min(found, key=lambda c: c.start) if found else None

    def _tag(self, text: str, start: int) -> _Candidate | None:
        at = text.find(TAG_OPEN, start)
        if at < 0:
            return None
        body_start = at + len(TAG_OPEN)
        close = text.find(TAG_CLOSE, body_start)
        if close < 0:
            return _Candidate(at, None, text[body_start:])
        return _Candidate(at, close + len(TAG_CLOSE), text[body_start:close])

    def _json_forms(self, text: str, start: int) -> list[_Candidate | None]:
        if self.parser != "json":
            return []
        return [self._fence(text, start), self._bare(text, start)]

    def _fence(self, text: str, start: int) -> _Candidate | None:
        at = text.find(FENCE, start)
        if at < 0:
            return None
        line_end = text.find("\n", at + len(FENCE))
        if line_end < 0:  # the fence's language tag is still coming
            return _Candidate(at, None, "")
        close = text.find(FENCE, line_end + 1)
        if close < 0:
            return _Candidate(at, None, text[line_end + 1:])
        return _Candidate(at, close + len(FENCE), text[line_end + 1:close])

    def _bare(self, text: str, start: int) -> _Candidate | None:
        """A bare object anywhere, or a bare list opening the answer."""
        at = text.find("{", start)
        if start == 0 or not text[:start].strip():
            first = len(text) - len(text.lstrip())
            if first < len(text) and text[first] == "[" and (at < 0 or first < at):
                at = first
        if at < 0:
            return None
        if self._bare_scan is None or self._bare_scan.start != at:
            self._bare_scan = _JsonScan(at)
        end = self._bare_scan.close(text)
        return _Candidate(at, end, text[at:end] if end is not None else text[at:])
