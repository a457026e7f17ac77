"""What the engine keeps of each request it runs, and the rows a request adds to a shared pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specstand.drafters import Draft, SequenceView
from specstand.engine.request import Request
from specstand.engine.stats import DecodeStats


@dataclass
class Running:
    """A request admitted to a cache slot: its prompt being computed, then decoding."""

    request: Request
    seq: SequenceView
    slot: int
    generator: torch.Generator
    stats: DecodeStats
    prompt_done: int = 0  # prompt positions whose K/V are cached; the request decodes once all are
    prompt_taps: list[dict[int, torch.Tensor]] = field(default_factory=list)  # tapped rows of those, in order
    # tapped hidden rows of the positions its decode passes kept, in order (kept only where a finished
    # request's answer stays reusable: see Engine._reuse_answers)
    answer_taps: list[dict[int, torch.Tensor]] = field(default_factory=list)
    drafted_upto: int = 0  # its length when the drafter was last asked for it (what the drafter has read)

    @property
    def decoding(self) -> bool:
        return self.prompt_done == self.seq.prompt_len

    @property
    def emitted(self) -> int:
        return len(self.seq.token_ids) - self.seq.prompt_len


@dataclass
class Work:
    """One request's rows in a shared pass: a draft to verify, or (draft None) a chunk of its prompt."""

    request_id: int
    state: Running
    tokens: list[int]
    draft: Draft | None

    @property
    def last_of_prompt(self) -> bool:
        return self.draft is None and self.state.prompt_done + len(self.tokens) == self.state.seq.prompt_len
