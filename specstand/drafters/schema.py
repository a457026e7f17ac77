"""Schema drafting: the text a tool call's structure forces, as the target's tokenizer writes it (how it works:
docs/drafters.md, section Schema drafting)."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Protocol

from specstand.drafters.base import Draft, Drafter, DraftingContext, HiddenRows, MethodSpec, SequenceView
from specstand.drafters.json_parts import (
    BREAKS,
    FITS,
    answer_structure,
    copied_value,
    layout_rest,
    mentions,
    ranked_choice,
)
from specstand.drafters.json_reader import AnswerReader, Forced, forced_text
from specstand.drafters.suffix import Keep, SuffixConfig, SuffixDrafter

# samples of what may follow forced text where the structure does not say: no token of the text that one of
# them would change is drafted, nor its last token ("" is the end of the answer)
SAMPLE_FOLLOWERS = ("", "a", "S", "1", " ", "\n", '"', "'", "{", "}", "[", "]", ",", ":", ".", "-", "_", "$", "<", "`")


class TextCodec(Protocol):
    """The target's tokenizer, as a drafter uses it: text <-> token ids, no special tokens added."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class HFTextCodec:
    """A transformers tokenizer as a `TextCodec` (decoding keeps every character: no space clean-up)."""

    tokenizer: object

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # a fast tokenizer's Rust backend directly: the same ids without transformers' per-call wrapping, which
        # cost a millisecond per batch (a draft asks for several)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@dataclass(frozen=True)
class SchemaConfig:
    suffix: SuffixConfig = field(default_factory=SuffixConfig)
    tail_tokens: int = 8  # answer tokens encoded again with the forced text (BPE merges reach no further back)
    max_forced_chars: int = 160  # forced text looked at per draft (far more than K tokens of it)
    key_order_confidence: float = 0.5  # an optional argument guessed as the next in schema order
    layout_confidence: float = 0.9  # a date or time value's separators where its description gives the layout


@dataclass
class _Answer:
    """One request's reader and the answer text it has read."""

    reader: AnswerReader
    prompt: str  # the prompt's text, where values are copied from
    spoken: Counter  # the words the prompt speaks of outside the tool definitions (json_parts.mentions)
    called: Counter  # the functions the prompt's earlier calls named
    text: str = ""

    def read(self, text: str) -> AnswerReader:
        if not text.startswith(self.text):  # decoding changed behind us (a partial UTF-8 character completed)
            self.reader, self.text = AnswerReader(self.reader.structure), ""
        self.reader.feed(text[len(self.text) :])
        self.text = text
        return self.reader

    def guess(self, text: str) -> AnswerReader | None:
        """A reader of the answer read so far followed by drafted text (None where their decoding differs)."""
        if not text.startswith(self.text):
            return None
        reader = self.reader.clone()
        reader.feed(text[len(self.text) :])
        return reader


class SchemaDrafter(Drafter):
    name = "schema"

    def __init__(self, codec: TextCodec, config: SchemaConfig | None = None) -> None:
        self.codec = codec
        self.config = config or SchemaConfig()
        self.suffix = SuffixDrafter(self.config.suffix)
        self._answers: dict[int, _Answer] = {}

    def forget(self) -> None:
        self.suffix.forget()

    def begin(self, seq: SequenceView) -> None:
        self.suffix.begin(seq)
        prompt_text = self.codec.decode(seq.token_ids[: seq.prompt_len])
        structure = answer_structure(seq.tools, seq.response_format, "" if seq.tools else prompt_text)
        if structure is not None:
            spoken, called = mentions(prompt_text, seq.tools, list(structure.functions))
            self._answers[seq.request_id] = _Answer(AnswerReader(structure), prompt_text, spoken, called)

    def propose(self, seq: SequenceView, max_tokens: int) -> Draft:
        """Forced tokens where the structure forces them, else likely text (a function name or key chosen, the
        rest of a value the prompt's text holds), else suffix decoding's guess up to where the structure forces
        something else, in turns. A token's confidence is the chance that the draft survives to it as suffix
        statistics (or a choice's share, or the share of the prompt's occurrences of a copied value that agree)
        tell; forced text does not lower it."""
        if max_tokens <= 0:
            return Draft([])
        tokens: list[int] = []
        confidence: list[float] = []
        survival = 1.0
        forced = self._forced_tokens(seq, tokens)
        while len(tokens) < max_tokens:
            if forced:
                forced = forced[: max_tokens - len(tokens)]
                tokens += forced
                confidence += [survival] * len(forced)
                forced = self._forced_tokens(seq, tokens)
                continue
            likely, share = self._likely_tokens(seq, tokens)
            if likely:
                likely = likely[: max_tokens - len(tokens)]
                tokens += likely
                survival *= share
                confidence += [survival] * len(likely)
                forced = self._forced_tokens(seq, tokens)
                continue
            view = replace(seq, token_ids=seq.token_ids + tokens)
            guess = self.suffix.propose(view, max_tokens - len(tokens), self._fitting(seq, tokens))
            if not guess.tokens:
                break
            kept = self._until_structure(seq, tokens, guess.tokens)
            tokens += guess.tokens[:kept]
            confidence += [survival * p for p in (guess.confidence or [])[:kept]]
            survival = confidence[-1] if confidence else survival
            forced = self._forced_tokens(seq, tokens)
            if kept == len(guess.tokens) and not forced:  # the guess ran out where the structure leaves a choice
                break
        return Draft(tokens, confidence=confidence)

    def extend(self, seq: SequenceView, new_tokens: list[int], hidden: HiddenRows | None = None) -> None:
        self.suffix.extend(seq, new_tokens, hidden)

    def end(self, seq: SequenceView) -> None:
        self.suffix.end(seq)
        self._answers.pop(seq.request_id, None)

    def _reader_after(self, seq: SequenceView, drafted: list[int]) -> tuple[_Answer | None, AnswerReader | None]:
        """The request's answer and a reader of it followed by `drafted` (None where their decoding differs).
        With nothing drafted this reads the answer's new text; a draft's first step does so before its guesses
        are read behind it."""
        answer = self._answers.get(seq.request_id)
        if answer is None:
            return None, None
        text = self.codec.decode(seq.output_ids + drafted)
        return answer, answer.read(text) if not drafted else answer.guess(text)

    def _fitting(self, seq: SequenceView, drafted: list[int]) -> Keep | None:
        """The rule suffix decoding's guesses after `drafted` grow by: text that fits the schema (AnswerReader.fit:
        a key among the object's unwritten properties, a value of its type, an enum value), so that a guess
        copied from the tool definitions in the prompt (`{"type": "string"`) gives way to the likeliest one
        that fits."""
        _, reader = self._reader_after(seq, drafted)
        if reader is None or reader.strayed:  # an answer that does not follow the schema is not held to it
            return None
        before_ids = seq.output_ids + drafted

        # the guess's text is decoded behind the answer's last few tokens only (a byte-level token may end
        # inside a character; a whole re-decode of the answer per tried token cost more than the pass saved)
        tail = before_ids[-self.config.tail_tokens :]
        tail_text = self.codec.decode(tail)

        judged: dict[tuple[int, ...], int | None] = {}  # every match length grows through the same guesses

        def keep(guess: list[int]) -> int | None:
            key = tuple(guess)
            if key not in judged:
                text = self.codec.decode(tail + guess)
                # a guess that changes how the answer's last character decodes: no judgement
                fit = reader.fit(text[len(tail_text) :]) if text.startswith(tail_text) else FITS
                judged[key] = None if fit == BREAKS else fit
            return judged[key]

        return keep

    def _likely_tokens(self, seq: SequenceView, drafted: list[int]) -> tuple[list[int], float]:
        """Text the structure leaves open but the request makes likely, in the answer's tokens, and its
        confidence, with the forced text after it: a choice (`_chosen_text`), else a date's or time's separators
        (`_laid_out_text`), else the rest of a value the prompt's text holds (`_copied_text`)."""
        answer, reader = self._reader_after(seq, drafted)
        if reader is None:
            return [], 0.0
        likely = self._chosen_text(answer, reader) or self._laid_out_text(reader) or self._copied_text(answer, reader)
        if likely is None:
            return [], 0.0
        rest, confidence = likely
        # drafted with the forced text after it: the tokens at their boundary (`",`) are then known
        probe = reader.clone()
        probe.feed(rest)
        then = forced_text(probe, self.config.max_forced_chars)
        answer_ids = seq.output_ids + drafted
        tokens = continuation_tokens(self.codec, answer_ids, Forced(rest + then.text, then.followers),
                                     self.config.tail_tokens)
        return tokens, confidence

    def _chosen_text(self, answer: _Answer, reader: AnswerReader) -> tuple[str, float] | None:
        """Where the answer writes a function name (or an enum value) that several offered ones begin with: the
        rest of the one whose words the prompt speaks of most outside the tool definitions (the user asked for
        supplier ratings: `Vehicle_Supplier_Ratings`), with its share of such words. Where it writes a key no
        required property forces: the next property in schema order. None elsewhere."""
        choices = reader.open_choices()
        if choices is not None:
            return ranked_choice(answer.spoken, answer.called, *choices)
        key = reader.key_in_order()
        return (key[1][len(key[0]) :] + '"', self.config.key_order_confidence) if key is not None else None

    def _laid_out_text(self, reader: AnswerReader) -> tuple[str, float] | None:
        """Where the answer writes a value whose schema gives a date or time layout (`Format: YYYY-MM-DD`): the
        separators it puts next, or the closing quote after its last digit."""
        layout = reader.open_layout()
        rest = layout_rest(layout[1], layout[0]) if layout is not None else None
        return (rest, self.config.layout_confidence) if rest is not None else None

    @staticmethod
    def _copied_text(answer: _Answer, reader: AnswerReader) -> tuple[str, float] | None:
        """Where the answer writes a value whose start the prompt holds (a word of the user's, a tool result's
        field) but no token sequence matches (the prompt splits it into other tokens): the rest of it, as
        `copied_value` reads the prompt's text, and the share of the prompt's occurrences that agree."""
        value, layout = reader.open_value(), reader.open_layout()
        if value is None or not value[1]:
            return None
        return copied_value(answer.prompt, *value, layout=layout[1] if layout is not None else None)

    def _until_structure(self, seq: SequenceView, drafted: list[int], guess: list[int]) -> int:
        """How many tokens of suffix decoding's `guess` (after `drafted`) to keep: all, or those before the
        first point where the structure forces text other than the guess's next token's (e.g. past a value the
        guess copied, where the schema's next key follows)."""
        answer = self._answers.get(seq.request_id)
        if answer is None:
            return len(guess)
        # compared as text: the forced text's tokens need ~20 encodings (continuation_tokens), its text none
        base = seq.output_ids + drafted
        before = self.codec.decode(base + guess[:1])
        for kept in range(1, len(guess)):
            after = self.codec.decode(base + guess[: kept + 1])
            reader = answer.guess(before)
            forced = forced_text(reader, self.config.max_forced_chars).text if reader is not None else ""
            if not forced and reader is not None:  # a name or key chosen there cuts a guess that writes another
                forced = (self._chosen_text(answer, reader) or ("", 0.0))[0]
            step = after[len(before) :] if after.startswith(before) else ""
            if forced and step and not (forced.startswith(step) or step.startswith(forced)):
                return kept
            before = after
        return len(guess)

    def _forced_tokens(self, seq: SequenceView, drafted: list[int] | None = None) -> list[int]:
        """The forced tokens after the answer so far and the tokens `drafted` after it in this draft."""
        _, reader = self._reader_after(seq, drafted or [])
        if reader is None:
            return []
        forced = forced_text(reader, self.config.max_forced_chars)
        answer_ids = seq.output_ids + (drafted or [])
        return continuation_tokens(self.codec, answer_ids, forced, self.config.tail_tokens) if forced.text else []


def continuation_tokens(codec: TextCodec, answer_ids: list[int], forced: Forced, tail_tokens: int) -> list[int]:
    """The tokens the forced text adds after `answer_ids` as `codec` writes them, as far as what follows
    cannot change them; [] where the answer's own last tokens are not what encoding its text would give
    (the target split differently there: where its next token starts is not known)."""
    followers = forced.followers if forced.followers is not None else SAMPLE_FOLLOWERS
    for n in dict.fromkeys((min(tail_tokens, len(answer_ids)), min(2, len(answer_ids)))):
        tail = answer_ids[len(answer_ids) - n :]
        head = codec.decode(tail)
        encodings = encode_all(codec, [head + forced.text + follower for follower in followers])
        if all(ids[:n] == tail for ids in encodings):
            stable = os.path.commonprefix([ids[n:] for ids in encodings])
            # where anything may follow, the forced text's own last token is not drafted either
            return stable if forced.followers is not None else stable[: len(codec.encode(head + forced.text)) - n - 1]
    return []


def encode_all(codec: TextCodec, texts: list[str]) -> list[list[int]]:
    """Every text's tokens, in one call where the codec batches (a fast tokenizer: one call instead of 20)."""
    batch = getattr(codec, "encode_batch", None)
    return batch(texts) if batch is not None else [codec.encode(text) for text in texts]


def _make(context: DraftingContext) -> SchemaDrafter:
    return SchemaDrafter(HFTextCodec(context.tokenizer))


METHOD = MethodSpec("schema", "the text a request's tools or response format force, else suffix drafts",
                    make=_make, vllm_names=("schema",), needs=("tokenizer",))
