"""The one small interface every drafter implements.

The engine owns the sequences and calls, in order: `begin` when a request is admitted, then per step
`propose_many` for every running request at once (by default `propose` for each: up to k tokens,
optionally with their draft distributions) and `extend` with the tokens the target emitted (trained
drafters also get the target's hidden states of the positions it just cached), and `end` when the request
finishes. Drafters never call back into the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class SequenceView:
    """What a drafter may read of a request."""

    request_id: int
    token_ids: list[int]  # prompt + every emitted token (the last one not yet in the target cache)
    prompt_len: int
    temperature: float = 0.0  # the request's sampling temperature (0: greedy), for drafters that sample
    tools: list[dict] | None = None  # the functions offered (OpenAI tools), for drafters that follow their schemas
    response_format: dict | None = None  # the request's response format (json_object / json_schema), likewise

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]


@dataclass
class HiddenRows:
    """Target hidden states of consecutive positions start, start + 1, ...: layer -> [rows, hidden]."""

    start: int
    taps: dict[int, torch.Tensor]

    @property
    def rows(self) -> int:
        return len(next(iter(self.taps.values()))) if self.taps else 0

    def positions(self) -> torch.Tensor:
        return self.start + torch.arange(self.rows)


def join_rows(rows: list[HiddenRows], layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stretches of hidden rows as one: their positions [T] and concatenated fp32 taps [T, layers x H]. A
    layer's pieces (a prompt's megabytes, then a row a pass) are joined in their own dtype and written once
    into their columns: no per-piece conversions or intermediate copies."""
    width = rows[0].taps[layers[0]].shape[-1]
    taps = torch.empty(sum(h.rows for h in rows), len(layers) * width)
    for i, layer in enumerate(layers):
        taps[:, i * width : (i + 1) * width] = torch.cat([h.taps[layer] for h in rows])
    return torch.cat([h.positions() for h in rows]), taps


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab]; None means one-hot (no probabilities)
    # the drafter's own per-token confidence signal, any scale (higher: likelier accepted); adaptive
    # verification learns how it maps to acceptance
    confidence: list[float] | None = None
    calibrated: bool = False  # confidence is a logit of the acceptance probability (DSpark's confidence head)

    def cut(self, n: int) -> Draft:
        """The first n tokens (all of them if there are fewer)."""
        if n >= len(self.tokens):
            return self
        return Draft(self.tokens[:n], None if self.probs is None else self.probs[:n],
                     None if self.confidence is None else self.confidence[:n], self.calibrated)


class Drafter(ABC):
    name: str = ""
    tap_layers: tuple[int, ...] = ()  # target hidden states this drafter needs (HF numbering)
    # True where every further draft token costs another drafter step (a chain: EAGLE-3, MTP): adaptive
    # verification then drafts no deeper than it expects to verify. A block drafter's pass, or a lookup,
    # costs the same at any depth, so cutting the draft before it is priced would only lose tokens.
    cost_grows_with_depth: bool = False

    @property
    def default_k(self) -> int:
        """K when the user gives none: the draft tokens one pass verifies."""
        return 5

    def begin(self, seq: SequenceView) -> None:  # noqa: B027 - optional hook
        """A request was admitted."""

    @abstractmethod
    def propose(self, seq: SequenceView, max_tokens: int) -> Draft:
        """Up to `max_tokens` guessed tokens following `seq.token_ids`."""

    def propose_many(self, seqs: list[SequenceView], max_tokens: list[int]) -> list[Draft]:
        """Drafts for several requests in one call (a budget <= 0 gets an empty draft). By default one
        `propose` each; drafters whose work batches (one drafter pass over every request's block) override
        it."""
        return [self.propose(seq, k) if k > 0 else Draft([]) for seq, k in zip(seqs, max_tokens, strict=True)]

    def extend(  # noqa: B027 - optional hook
        self, seq: SequenceView, new_tokens: list[int], hidden: HiddenRows | None = None
    ) -> None:
        """`new_tokens` were appended to `seq.token_ids` (accepted draft + target token). `hidden` holds
        the target's `tap_layers` at the positions that entered its cache with this pass (only for
        drafters that ask for taps). Not called for the pass that finishes a request."""

    def end(self, seq: SequenceView) -> None:  # noqa: B027 - optional hook
        """The request finished; `seq.output_ids` is its answer."""

    def forget(self) -> None:  # noqa: B027 - optional hook
        """Drop what was learned from finished requests (earlier answers), as if none had been served: the
        stand starts every measured run from the same state."""


@dataclass(frozen=True)
class DraftingContext:
    """What a training-free method's factory may use: the target's tokenizer (transformers), n-gram sizes."""

    tokenizer: object | None = None
    ngram: object | None = None  # ngram.NgramConfig


@dataclass(frozen=True)
class TrainedParts:
    """How a trained method is built: the target layers it taps by default (for a target of L layers; block
    methods also take how many), its model from a spec (drafters/nn.py DrafterSpec), the target's parts and
    the draft-to-target vocabulary map, and the inference Drafter around that model."""

    tap_layers: Callable[..., list[int]]
    build: Callable
    wrap: Callable


@dataclass(frozen=True)
class MethodSpec:
    """One drafting method, declared in its own module and listed once in registry.py: everything the CLI,
    the server, the stand, training and export need to know of it."""

    name: str
    summary: str  # what drafts, in a few words (CLI help)
    make: Callable[[DraftingContext], Drafter] | None = None  # training-free methods
    trained: TrainedParts | None = None  # trained methods (loaded from a drafter folder)
    block: bool = False  # one drafter pass per block of drafts (its folder's block size sets K)
    vllm_names: tuple[str, ...] = ()  # vLLM's --speculative-config method names that mean it
    needs: tuple[str, ...] = ()  # what it reads of the target: "tokenizer", "hidden states"
