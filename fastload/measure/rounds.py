"""Interleaved rounds: the median of a stage's rounds, its 95% interval, and "within noise".

Owns: the statistics that turn R rounds of per-step records into one figure people can
trust, and the order stages run in each round. No I/O, no torch.

* The figure is the **median over rounds** of each round's images/s (images / wall time
  of that round's measured steps).
* The 95% interval is a **hierarchical bootstrap** (2,000 resamples, fixed seed): each
  resample draws R rounds with replacement, then each drawn round's steps with
  replacement, and takes the median of the resampled rounds' images/s; the interval is
  the 2.5th-97.5th percentile of those medians. Resampling rounds carries the
  round-to-round drift of the machine (what interleaving is for), resampling steps the
  step-to-step jitter; with one round it is a plain bootstrap over steps.
* Two figures are **within noise** of each other when their intervals overlap.
* Round ``k`` runs the stages rotated by ``k`` places, so no stage always follows the
  same neighbour (a stage's left-over workers or page cache would otherwise always bill
  the same next stage).
* ``interleave`` is the one loop every comparison runs (recipes, ``bench loader``,
  ``bench decode``, ``bench encode``, the ``--max-side`` advice, the profiler-overhead
  bench, ``bench serve``): every arm once per round in the rotated order, each value kept
  with its round and position; ``Arm`` gives the median, the min..max spread and the
  per-round ratios to a baseline arm measured in the same round.

Must not: run stages (``recipe.py``) or format tables (``report.py``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

__all__ = ["round_rate", "median_and_interval", "overlap", "rotated", "BOOTSTRAP_RESAMPLES", "Arm", "interleave"]

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

BOOTSTRAP_RESAMPLES = 2000


def round_rate(images: Sequence[float], seconds: Sequence[float]) -> float:
    """Images per second of one round's steps."""
    total = float(np.sum(seconds))
    return float(np.sum(images)) / total if total > 0 else 0.0


def median_and_interval(rounds: Sequence[tuple[Sequence[float], Sequence[float]]], *,
                        resamples: int = BOOTSTRAP_RESAMPLES, confidence: float = 0.95,
                        seed: int = 0) -> tuple[float, tuple[float, float]]:
    """The median of the rounds' images/s and its hierarchical-bootstrap interval.

    Args:
        rounds: per round, ``(images per step, seconds per step)``.

    Raises:
        ValueError: no rounds, or a round without steps.
    """
    if not rounds:
        raise ValueError("need at least one round")
    rng = np.random.default_rng(seed)
    boot = np.empty((len(rounds), resamples))
    for k, (images, seconds) in enumerate(rounds):
        im, sec = np.asarray(images, dtype=float), np.asarray(seconds, dtype=float)
        if im.size == 0 or im.size != sec.size:
            raise ValueError(f"round {k}: needs one images and one seconds value per step")
        idx = rng.integers(0, im.size, size=(resamples, im.size))
        boot[k] = im[idx].sum(axis=1) / sec[idx].sum(axis=1)
    picks = rng.integers(0, len(rounds), size=(resamples, len(rounds)))
    draws = rng.integers(0, resamples, size=(resamples, len(rounds)))
    medians = np.median(boot[picks, draws], axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    figure = float(np.median([round_rate(im, sec) for im, sec in rounds]))
    return figure, (float(low), float(high))


def overlap(a: Sequence[float] | None, b: Sequence[float] | None) -> bool:
    """Whether two ``[low, high]`` intervals overlap (False when either is missing)."""
    if not a or not b:
        return False
    return a[0] <= b[1] and b[0] <= a[1]


def rotated(items: Sequence[T], k: int) -> list[T]:
    """``items`` rotated left by ``k`` places (round ``k``'s order)."""
    if not items:
        return []
    k %= len(items)
    return list(items[k:]) + list(items[:k])


@dataclass
class Arm(Generic[V]):
    """One arm's values over the rounds: ``values[i]`` was measured in round ``rounds[i]``, at
    ``positions[i]`` in that round's order (0 = first)."""

    values: list[V] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)

    def median(self) -> float:
        return float(statistics.median(self.values))  # type: ignore[type-var]

    def spread(self) -> tuple[float, float]:
        """The lowest and highest round."""
        return float(min(self.values)), float(max(self.values))  # type: ignore[type-var]

    def ratios_to(self, base: Arm) -> list[float]:
        """Per round this arm ran in and ``base`` did too: this arm's value / the base's, in round order."""
        by_round = dict(zip(base.rounds, base.values))
        return [v / by_round[k] for k, v in zip(self.rounds, self.values) if k in by_round]


def interleave(arms: Sequence[K], rounds: int, measure: Callable[[K, int], V | None]) -> dict[K, Arm[V]]:
    """Measure every arm once per round, round ``k`` in the order rotated by ``k`` places.

    ``measure(arm, k)`` returns the arm's value in round ``k``, or None for no value (an arm
    that cannot run, or was skipped: it keeps its place in the order, no value is recorded).
    Exceptions propagate.

    Returns:
        Per arm (in ``arms``' order), its values with their rounds and positions.
    """
    out: dict[K, Arm[V]] = {a: Arm() for a in arms}
    for k in range(rounds):
        for position, arm in enumerate(rotated(arms, k)):
            value = measure(arm, k)
            if value is not None:
                out[arm].values.append(value)
                out[arm].rounds.append(k)
                out[arm].positions.append(position)
    return out
