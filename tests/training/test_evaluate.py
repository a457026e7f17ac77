"""eval-drafter's statistics."""

from specstand.training.evaluate import wilson_interval


def test_wilson_interval_by_hand():
    low, high = wilson_interval(8, 10)  # p 0.8, n 10: centre 0.7167, half-width 0.2266
    assert abs(low - 0.4902) < 1e-3 and abs(high - 0.9433) < 1e-3
    assert wilson_interval(0, 0) == (0.0, 1.0) and wilson_interval(5, 5)[1] == 1.0
