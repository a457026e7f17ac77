"""Prompt lookup: find the latest earlier occurrence of the last n tokens and propose what followed it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specstand.drafters.base import Draft, Drafter, MethodSpec, SequenceView


@dataclass(frozen=True)
class NgramConfig:
    min_n: int = 3
    max_n: int = 5

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError("ngram sizes need 1 <= min_n <= max_n")


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()

    def propose(self, seq: SequenceView, max_tokens: int) -> Draft:
        context = np.asarray(seq.token_ids, dtype=np.int64)
        if max_tokens <= 0:
            return Draft([])
        for n in range(self.config.max_n, self.config.min_n - 1, -1):
            if len(context) <= n:
                continue
            # windows that start early enough to have at least one following token
            windows = sliding_window_view(context[:-1], n)
            hits = np.flatnonzero((windows == context[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the most recent match
                tokens = context[start : start + max_tokens].tolist()
                return Draft(tokens, confidence=[float(n)] * len(tokens))  # longer matches: stronger evidence
        return Draft([])


METHOD = MethodSpec("ngram", "prompt lookup", make=lambda context: NgramDrafter(context.ngram), vllm_names=("ngram",))
