"""rounds.py: the median over rounds, its bootstrap interval, overlap and rotation."""

from __future__ import annotations

import numpy as np
import pytest

from fastload.measure.rounds import median_and_interval, overlap, rotated


def _round(rate: float, steps: int = 20, jitter: float = 0.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    seconds = np.full(steps, 64 / rate) * (1 + jitter * rng.standard_normal(steps))
    return [64] * steps, list(seconds)


def test_median_of_rounds_and_an_exact_interval_without_noise():
    figure, (low, high) = median_and_interval([_round(100), _round(300), _round(200)])
    assert figure == pytest.approx(200)
    # steps are identical within a round: only the choice of rounds varies, so the
    # interval spans the rounds' rates and no further
    assert low == pytest.approx(100) and high == pytest.approx(300)
    figure, (low, high) = median_and_interval([_round(250)])
    assert figure == low == high == pytest.approx(250)


def test_interval_widens_with_step_jitter_and_covers_the_truth():
    narrow = median_and_interval([_round(200, jitter=0.02, seed=k) for k in range(3)])[1]
    wide = median_and_interval([_round(200, jitter=0.2, seed=k) for k in range(3)])[1]
    assert wide[1] - wide[0] > 3 * (narrow[1] - narrow[0])
    assert wide[0] < 200 < wide[1]


def test_bad_rounds():
    with pytest.raises(ValueError, match="at least one round"):
        median_and_interval([])
    with pytest.raises(ValueError, match="round 0"):
        median_and_interval([([], [])])


def test_overlap_and_rotation():
    assert overlap([1, 2], [2, 3]) and overlap([1, 5], [2, 3]) and not overlap([1, 2], [2.5, 3])
    assert not overlap(None, [1, 2])
    assert rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rotated(["a", "b", "c"], 1) == ["b", "c", "a"] and rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert rotated([], 3) == []
