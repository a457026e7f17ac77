"""Drafters, one file per method, all behind `Drafter` (base.py)."""

from __future__ import annotations

from collections.abc import Callable

from specstand.drafters.base import Draft, Drafter, SequenceView
from specstand.drafters.ngram import NgramConfig, NgramDrafter
from specstand.drafters.suffix import SuffixConfig, SuffixDrafter

# method name -> factory; `none` means no drafter
DRAFTERS: dict[str, Callable[[], Drafter]] = {
    "ngram": NgramDrafter,
    "suffix": SuffixDrafter,
}
METHODS = ("none", *DRAFTERS)


def make_drafter(method: str) -> Drafter | None:
    if method == "none":
        return None
    if method not in DRAFTERS:
        raise ValueError(f"unknown method {method!r} (choose from {', '.join(METHODS)})")
    return DRAFTERS[method]()


__all__ = ["DRAFTERS", "METHODS", "Draft", "Drafter", "NgramConfig", "SequenceView", "SuffixConfig", "make_drafter"]
