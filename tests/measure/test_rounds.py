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


def test_interleave_rotates_records_positions_and_ratios_within_a_round():
    from fastload.measure.rounds import interleave

    calls = []
    speed = {"a": 100.0, "b": 200.0, "c": 50.0}

    def measure(arm, k):
        calls.append((k, arm))
        if arm == "c" and k == 1:
            return None  # no value this round: nothing recorded, the order is kept
        return speed[arm] * (1 + k)  # the machine gets faster each round: ratios within a round cancel it

    got = interleave(["a", "b", "c"], 3, measure)
    assert calls == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"), (2, "c"), (2, "a"), (2, "b")]
    assert list(got) == ["a", "b", "c"]
    assert got["a"].values == [100, 200, 300] and got["a"].rounds == [0, 1, 2] and got["a"].positions == [0, 2, 1]
    assert got["c"].rounds == [0, 2] and got["c"].positions == [2, 0]
    assert got["b"].median() == 400 and got["b"].spread() == (200, 600)
    assert got["b"].ratios_to(got["a"]) == [2.0, 2.0, 2.0]
    assert got["c"].ratios_to(got["a"]) == [0.5, 0.5]
