import pytest

from specstand.drafters import NgramConfig, SequenceView
from specstand.drafters.ngram import NgramDrafter


def _seq(tokens, prompt_len=None):
    return SequenceView(0, list(tokens), len(tokens) if prompt_len is None else prompt_len)


def test_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter(NgramConfig(min_n=2, max_n=3))
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 0, 2, 3]
    # last 3 tokens [0, 2, 3] never occurred; last 2 [2, 3] occurred twice, the latest is followed by 7, 8
    assert drafter.propose(_seq(tokens), 2).tokens == [7, 8]
    assert drafter.propose(_seq(tokens), 10).tokens == [7, 8, 0, 2, 3]


def test_longer_ngrams_win():
    drafter = NgramDrafter(NgramConfig(min_n=1, max_n=3))
    tokens = [5, 6, 7, 1, 6, 7, 2, 9, 5, 6, 7]
    assert drafter.propose(_seq(tokens), 1).tokens == [1]  # [5, 6, 7] matched at the start


def test_no_match_and_zero_budget():
    drafter = NgramDrafter()
    assert drafter.propose(_seq([1, 2, 3, 4, 5, 6]), 5).tokens == []
    assert drafter.propose(_seq([1, 2, 3, 1, 2, 3]), 0).tokens == []


def test_config_validation():
    with pytest.raises(ValueError):
        NgramConfig(min_n=4, max_n=3)
