"""What an agent's answer must write next, given the tools and response format of its request.

`AnswerReader` follows an answer's text character by character: prose, then a tool call written as a bare
JSON object, inside a ```json fence or inside <tool_call> tags (or the JSON a response format asks for). In
the JSON it keeps a stack of the open containers and strings, each with the JSON Schema it should follow.
`forced_text` chains the steps that leave no choice while the answer keeps to the schema: punctuation,
required keys in schema order (`"name"`, then `"arguments"`, then the function's parameters), the rest of a
key, function name or enum value once its prefix is unique, `true`/`false`/`null` after their first letter,
closing braces, the wrapper's closing. Whitespace follows what the answer has written so far (json.dumps'
`", "` and `": "` until then). Text that leaves the schema stops the reading until the next JSON opens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from specstand.drafters.json_parts import (
    BREAKS,
    DIGITS,
    FITS,
    AnswerStructure,
    _Array,
    _completion,
    _enum,
    _Frame,
    _Object,
    _opening_fit,
    _Scalar,
    _String,
    _string_fit,
    _string_values,
    _Style,
    follows_layout,
    layout_rest,
    value_layout,
)

TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"
KEYWORDS = ("true", "false", "null")
_SCALAR_CHARS = frozenset("0123456789+-.eEtrufalsn")
_CLOSERS = {"tag": "\n" + TAG_CLOSE, "fence": "\n" + FENCE_CLOSE, "bare": ""}


def _opener(schema: dict) -> str:
    """The text a value of `schema` must start with ("" where its type leaves a choice)."""
    values = _enum(schema)
    if values is not None:
        return '"' if all(isinstance(v, str) for v in values) else ""
    kind = schema.get("type")
    return {"string": '"', "object": "{", "array": "[", "null": "null"}.get(kind, "") if isinstance(kind, str) else ""


class AnswerReader:
    """Follows an answer's text; `forced_step` says what must come next while it keeps to the structure."""

    def __init__(self, structure: AnswerStructure) -> None:
        self.structure = structure
        self.mode = "prose"  # prose, opening (a wrapper opened, its '{' to come), json, closing (the wrapper's)
        self.wrapper = "bare"  # tag, fence or bare
        self.line = ""  # prose: the current line so far
        self.pending = ""  # opening: whitespace since the wrapper's opener; closing: the closer read so far
        self.stack: list[_Frame] = []
        self.style = _Style()
        self.ended = False  # the last character read closed a call (or the JSON the answer was to write)
        # the answer wrote a key the schema does not have, or a value of another type (a string excepted): its
        # JSON follows something else (seen: a small model writing out the tool definitions themselves)
        self.strayed = False

    def clone(self) -> AnswerReader:
        other = AnswerReader(self.structure)
        other.mode, other.wrapper, other.line, other.pending = self.mode, self.wrapper, self.line, self.pending
        other.ended, other.strayed = self.ended, self.strayed
        other.stack = [frame.copy() for frame in self.stack]
        other.style = replace(self.style)
        return other

    def feed(self, text: str) -> None:
        for char in text:
            self._read(char)

    # reading

    def _read(self, char: str) -> None:
        self.ended = False
        if self.mode == "json":
            if not self._read_json(char):
                self._to_prose()  # the answer left the schema: wait for the next JSON to open
            elif not self.stack:
                self.mode, self.pending = "closing", ""
                if not _CLOSERS[self.wrapper]:
                    self._to_prose()
                    self.ended = True
        elif self.mode == "prose":
            self._read_prose(char)
        elif self.mode == "opening":
            if char.isspace():
                self.pending += char
            elif char == "{":
                self._open_root()
            else:
                self._to_prose()
                self._read_prose(char)
        else:  # closing
            closer = _CLOSERS[self.wrapper]
            if closer.startswith(self.pending + char):
                self.pending += char
                if self.pending == closer:
                    self._to_prose()
                    self.ended = True
            else:
                self._to_prose()
                self._read_prose(char)

    def _read_prose(self, char: str) -> None:
        if char == "{":  # an agent's answer opens braces for its call only
            self.wrapper = "bare"
            self._open_root()
        elif char == "\n":
            fence = self.line.strip() == FENCE_OPEN
            self.line = ""
            if fence:
                self.mode, self.wrapper, self.pending = "opening", "fence", ""
        else:
            self.line += char
            if self.line.endswith(TAG_OPEN):
                self.mode, self.wrapper, self.pending = "opening", "tag", ""

    def _to_prose(self) -> None:
        self.mode, self.line, self.stack = "prose", "", []

    def _open_root(self) -> None:
        schema, functions = self.structure.root()
        self.mode = "json"
        self.stack = [_Object(schema, functions)]

    def _read_json(self, char: str) -> bool:
        """Read one character of the JSON; False where it cannot follow what was written."""
        frame = self.stack[-1]
        if isinstance(frame, _String):
            return self._read_string(frame, char)
        if isinstance(frame, _Scalar):
            if char in _SCALAR_CHARS:
                frame.text += char
                if not any(k.startswith(frame.text) for k in KEYWORDS) and not _number_prefix(frame.text):
                    return False
                if frame.text in KEYWORDS:
                    self._value_done()
                return True
            if frame.text[0] in "tfn" or frame.text in ("-", ""):  # an unfinished keyword or sign
                return False
            self._value_done()
            return self._read_json(char)
        if char.isspace():
            frame.gap += char
            return True
        if isinstance(frame, _Object):
            return self._read_object(frame, char)
        return self._read_array(frame, char)

    def _read_string(self, frame: _String, char: str) -> bool:
        if frame.escaped:
            frame.text, frame.escaped = frame.text + char, False
        elif char == "\\":
            frame.text, frame.escaped = frame.text + char, True
        elif char == '"':
            self.stack.pop()
            parent = self.stack[-1]
            assert isinstance(parent, _Object | _Array)
            if frame.is_key:
                assert isinstance(parent, _Object)
                self.strayed = self.strayed or bool(parent.properties()) and frame.text not in parent.properties()
                parent.keys.append(frame.text)
                parent.phase, parent.gap = "colon", ""
            else:
                if isinstance(parent, _Object):
                    parent.strings[parent.keys[-1]] = frame.text
                self._after_value(parent)
        elif char < " ":  # JSON strings hold no raw control characters
            return False
        else:
            frame.text += char
        return True

    def _read_object(self, frame: _Object, char: str) -> bool:
        phase = frame.phase
        if phase in ("open", "key") and char == '"':
            self.style.learn("open" if phase == "open" else "comma", frame.gap, len(self.stack))
            self.stack.append(_String({}, is_key=True))
        elif phase in ("open", "next") and char == "}":
            self.style.learn("close", frame.gap, len(self.stack))
            self._value_done()
        elif phase == "colon" and char == ":":
            frame.phase, frame.gap = "value", ""
        elif phase == "value":
            self.style.learn("colon", frame.gap, len(self.stack))
            self.strayed = self.strayed or _opening_fit(frame.value_schema(), char) == BREAKS
            return self._open_value(frame.value_schema(), char)
        elif phase == "next" and char == ",":
            frame.phase, frame.gap = "key", ""
        else:
            return False
        return True

    def _read_array(self, frame: _Array, char: str) -> bool:
        if frame.phase in ("open", "next") and char == "]":
            self.style.learn("close", frame.gap, len(self.stack))
            self._value_done()
        elif frame.phase == "next" and char == ",":
            frame.phase, frame.gap = "value", ""
        elif frame.phase in ("open", "value"):
            self.style.learn("open" if frame.phase == "open" else "comma", frame.gap, len(self.stack))
            return self._open_value(frame.items(), char)
        else:
            return False
        return True

    def _open_value(self, schema: dict, char: str) -> bool:
        if char == '"':
            self.stack.append(_String(schema, is_key=False))
        elif char == "{":
            self.stack.append(_Object(schema))
        elif char == "[":
            self.stack.append(_Array(schema))
        elif char in "-0123456789tfn":
            self.stack.append(_Scalar(schema, char))
        else:
            return False
        return True

    def _value_done(self) -> None:
        """The top frame's value is complete."""
        self.stack.pop()
        if self.stack:
            parent = self.stack[-1]
            assert isinstance(parent, _Object | _Array)
            self._after_value(parent)

    @staticmethod
    def _after_value(parent: _Object | _Array) -> None:
        parent.phase, parent.gap = "next", ""
        if isinstance(parent, _Array):
            parent.count += 1

    def _open_frame(self) -> _Frame | None:
        """The innermost container, string or scalar the answer's JSON is in (None outside JSON)."""
        return self.stack[-1] if self.mode == "json" and self.stack else None

    def _open_string_value(self) -> _String | None:
        """The string value (not a key) the answer is writing, outside an escape; None elsewhere."""
        frame = self._open_frame()
        return frame if isinstance(frame, _String) and not frame.is_key and not frame.escaped else None

    def open_value(self) -> tuple[str, str] | None:
        """("string", its text so far) or ("scalar", its text so far) where the answer is writing a value (not a
        key), else None."""
        string = self._open_string_value()
        if string is not None:
            return "string", string.text
        frame = self._open_frame()
        return ("scalar", frame.text) if isinstance(frame, _Scalar) else None

    def open_choices(self) -> tuple[str, list[str]] | None:
        """(its text so far, its enum values) where the answer writes a string value that has them (a function
        name: the offered functions), else None."""
        string = self._open_string_value()
        values = _string_values(string.schema) if string is not None else []
        return (string.text, values) if string is not None and values else None

    def open_layout(self) -> tuple[str, str] | None:
        """(its text so far, its layout) where the answer writes a string value whose schema gives a date or time
        layout (`value_layout`), else None."""
        string = self._open_string_value()
        layout = value_layout(string.schema) if string is not None else None
        return (string.text, layout) if string is not None and layout is not None else None

    def key_in_order(self) -> tuple[str, str] | None:
        """(its text so far, the key it likely is) where the answer writes a key no required property forces:
        the next property in schema order (`_Object.next_in_order`) that begins with what is written."""
        frame = self._open_frame()
        if not isinstance(frame, _String) or not frame.is_key or frame.escaped:
            return None
        parent = self.stack[-2]
        assert isinstance(parent, _Object)
        if parent.next_required() is not None:
            return None
        key = parent.next_in_order(frame.text)
        return (frame.text, key) if key is not None else None

    def fit(self, text: str) -> int:
        """How well `text` keeps to the schema where the reader stands (the reader is not changed): FITS,
        QUOTED (somewhere a string where the schema says another type: models quote numbers and write
        references such as "$var1.id$" there) or BREAKS (JSON syntax broken, a key that begins none of the
        object's unwritten properties, a string that begins no enum value, a value opened as another type, or a
        value that is a JSON Schema type name: text copied from the tool definitions). Prose always fits."""
        probe, fit = self.clone(), FITS
        for char in text:
            fit = max(fit, probe._fit(char))
            in_json = probe.mode == "json"
            if fit == BREAKS:
                return BREAKS
            probe._read(char)
            if in_json and probe.mode == "prose" and not probe.ended:
                return BREAKS
        return fit

    def _fit(self, char: str) -> int:
        if self.mode != "json" or not self.stack:
            return FITS
        frame = self.stack[-1]
        if isinstance(frame, _String):
            return _string_fit(frame, self.stack[-2], char)
        if char.isspace():
            return FITS
        if isinstance(frame, _Object) and frame.phase == "value":
            return _opening_fit(frame.value_schema(), char)
        if isinstance(frame, _Array) and (frame.phase == "value" or (frame.phase == "open" and char != "]")):
            return _opening_fit(frame.items(), char)
        return FITS

    # what comes next

    def forced_step(self) -> str:
        """Text that must follow while the answer keeps to the structure ("" where it has a choice)."""
        if self.mode == "prose":
            if self.ended:
                return ""
            started = next((i for i in range(len(TAG_OPEN) - 1, 2, -1) if self.line.endswith(TAG_OPEN[:i])), 0)
            if started:
                return TAG_OPEN[started:]
            line = self.line.strip()
            if len(line) > len(FENCE_CLOSE) and FENCE_OPEN.startswith(line):  # "```" alone may open any fence
                return FENCE_OPEN[len(line) :] + "\n"
            return ""
        if self.mode == "opening":
            return ("\n" if self.wrapper == "tag" and not self.pending else "") + "{"
        if self.mode == "closing":
            return _CLOSERS[self.wrapper][len(self.pending) :]
        return self._forced_json()

    def _forced_json(self) -> str:
        frame = self.stack[-1]
        if isinstance(frame, _String):
            if frame.is_key:
                parent = self.stack[-2]
                assert isinstance(parent, _Object)
                guess = parent.next_required() if not frame.text else None
                return guess + '"' if guess is not None else _completion(frame.text, parent.unwritten())
            return _completion(frame.text, _string_values(frame.schema))
        if isinstance(frame, _Scalar):
            return next((k[len(frame.text) :] for k in KEYWORDS if k.startswith(frame.text)), "")
        if isinstance(frame, _Object):
            return self._forced_in_object(frame)
        return self._forced_in_array(frame)

    def _forced_in_object(self, frame: _Object) -> str:
        if frame.phase == "colon":
            return ":"
        if frame.phase == "value":
            return self._then(self._rest("colon", frame), _opener(frame.value_schema()))
        if frame.phase == "key":
            return self._then(self._rest("comma", frame), '"')
        if frame.phase == "open":
            return self._then(self._rest("open", frame), '"') if frame.next_required() else ""
        # next: a required key still to write, or every known key written
        if frame.next_required() is not None:
            return ","
        if frame.properties() and not frame.unwritten():
            return self._then(self._rest("close", frame), "}")
        return ""

    def _forced_in_array(self, frame: _Array) -> str:
        if frame.phase == "value":
            return self._then(self._rest("comma", frame), _opener(frame.items()))
        if frame.phase == "open":
            wanted = _item_count(frame.schema, "minItems")
            return self._then(self._rest("open", frame), _opener(frame.items())) if wanted else ""
        most = _item_count(frame.schema, "maxItems")
        return self._then(self._rest("close", frame), "]") if most is not None and frame.count >= most else ""

    def followers(self) -> tuple[str, ...] | None:
        """Every text that may follow where the reader stands, where the structure knows them all: the
        candidate keys or enum values a string's prefix leaves (each to its closing quote), or the end of
        the answer (or a newline before another call) after a call closed. None where anything may follow."""
        if self.ended:
            return ("", "\n")
        frame = self._open_frame()
        if not isinstance(frame, _String):
            return None
        if frame.is_key:
            parent = self.stack[-2]
            assert isinstance(parent, _Object)
            candidates = parent.unwritten()
        else:
            candidates = _string_values(frame.schema)
            layout = value_layout(frame.schema)
            if not candidates and layout is not None and layout_rest(layout, frame.text) is None \
                    and follows_layout(layout, frame.text):
                return DIGITS  # a laid-out value's next digit
        matching = [c[len(frame.text) :] + '"' for c in candidates if c.startswith(frame.text)]
        return tuple(matching) or None

    def _rest(self, kind: str, frame: _Object | _Array) -> str | None:
        """The `kind` whitespace still to come in `frame` (the innermost container), None where unknown."""
        return self.style.rest(kind, frame.gap, len(self.stack))

    @staticmethod
    def _then(whitespace: str | None, text: str) -> str:
        """Whitespace then `text`; where the whitespace is unknown, nothing is forced."""
        return "" if whitespace is None else whitespace + text


def _number_prefix(text: str) -> bool:
    """Whether `text` can begin a JSON number."""
    try:
        float(text + ("0" if text[-1] in "-+eE." else ""))
    except ValueError:
        return False
    return text.lstrip("-")[:1].isdigit() or text == "-"


@dataclass(frozen=True)
class Forced:
    """Text the answer must write next, and what may follow it: every possibility, or None where anything
    may (then the text's last token may yet merge with what follows)."""

    text: str
    followers: tuple[str, ...] | None


def forced_text(reader: AnswerReader, max_chars: int) -> Forced:
    """Every forced step from where `reader` stands, chained (about `max_chars` at most)."""
    probe, text = reader.clone(), ""
    while len(text) < max_chars:
        step = probe.forced_step()
        if not step:
            break
        probe.feed(step)
        text += step
    return Forced(text, probe.followers())


def _item_count(schema: dict, bound: str) -> int | None:
    """An array's minItems or maxItems where it is a count (tools' schemas come from clients: "2" is none)."""
    value = schema.get(bound)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
