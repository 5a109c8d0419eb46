"""Are a store's images far larger than training needs? The measured ``--max-side`` advice.

Owns: ``max_side_advice(store, size)``. It reads the sizes of a seeded sample of the
store's records from their headers (no decode). When the median longer side is at least
``FAR_LARGER`` times the recommended ``--max-side`` it times fastload's train preset
(``train_transform(size).from_bytes``, one thread, as a loader worker runs it) on those
records as stored and as ``fastload convert --max-side M`` would store them (the same
``image.policy.prepare`` call, with the store's own encoding options), in interleaved
rounds, and says how many times faster loading would be and at what share of the bytes.
``fastload convert`` prints it after a conversion, ``fastload inspect`` whenever asked.

Why ``M = 2 × size``: a random-resized crop is resized to ``size`` whatever its extent.
With the longer side at ``2 × size`` (a 4:3 image then has its shorter side at
``1.5 × size``), every crop of at least a third of the image still comes from at least
``size`` source pixels a side, so most crops lose nothing, and the eval preset
(resize the shorter side to ``size × 256/224``, centre crop) loses nothing at all.
FFCV's ImageNet configurations make the same trade (``max_resolution`` 256-512 for
160-224 px training).

Why in ``measure/``: the advice is a measurement (``timing.preset_ms_per_image`` in interleaved
rounds), not a fact read off the machine; ``cli/`` calls it after ``convert`` and ``inspect``.

Must not: write to the store; assert on timings.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from fastload.image import DEFAULT_SIZE

__all__ = ["MaxSideAdvice", "max_side_advice", "recommended_max_side", "FAR_LARGER"]

#: Advice is measured and given when the median longer side is at least this many times the
#: recommended ``--max-side`` (so at least 4x the training size).
FAR_LARGER = 2.0
#: Below this measured speed-up the advice says the reduction is not worth it.
WORTHWHILE = 1.5


def recommended_max_side(size: int) -> int:
    """The ``--max-side`` recommended for training crops of ``size`` pixels (module docstring: why)."""
    return 2 * size


@dataclass(frozen=True)
class MaxSideAdvice:
    """What the sample showed. ``speedup`` and the timings are None when nothing was measured
    (the images are not far larger than ``max_side``)."""

    store: str
    size: int
    sampled: int
    median_long_side: int
    max_side: int
    speedup: float | None = None
    ms_stored: float | None = None
    ms_reduced: float | None = None
    bytes_ratio: float | None = None
    rounds: int = 0

    @property
    def worthwhile(self) -> bool:
        return self.speedup is not None and self.speedup >= WORTHWHILE

    def message(self, source: str | None = None) -> str:
        """One line (two with the command) for a person."""
        head = (f"{self.sampled} sampled images: median longer side {self.median_long_side} px, "
                f"training at {self.size} px")
        if self.speedup is None:
            return f"{head}: not far larger than --max-side {self.max_side} would make them; no reduction advised."
        measured = (f"the train preset took {self.ms_stored:.1f} ms an image as stored and {self.ms_reduced:.1f} ms "
                    f"at --max-side {self.max_side} (median of {self.rounds} interleaved rounds, one thread)")
        if not self.worthwhile:
            return f"{head}: {measured}; {self.speedup:.2f}x is not worth a reduced store."
        cmd = f"fastload convert {source or 'SRC'} DST --max-side {self.max_side}"
        return (f"{head}: images are far larger than training needs. Loading would be {self.speedup:.1f}x faster "
                f"at {self.bytes_ratio:.0%} of the bytes ({measured}).\n  HINT: {cmd}")

    def to_json(self) -> dict:
        return asdict(self) | {"worthwhile": self.worthwhile}


def max_side_advice(store: str | os.PathLike[str], *, size: int = DEFAULT_SIZE, sample: int = 8, rounds: int = 3,
                    seed: int = 0) -> MaxSideAdvice:
    """Sample ``store`` and, when its images are far larger than training at ``size`` needs,
    measure what ``--max-side`` would buy (see the module docstring).

    Args:
        store: a complete store (or shard folder).
        size: the training crop size.
        sample: records sampled (seeded, without replacement).
        rounds: interleaved timing rounds (stored, reduced; the order alternates).
    """
    from fastload.image.fast import image_size
    from fastload.image.policy import prepare
    from fastload.store.reader import StoreReader

    if size < 8 or sample < 1 or rounds < 1:
        raise ValueError("size >= 8, sample >= 1 and rounds >= 1 are required")
    reader = StoreReader(store)  # no torch until something is timed: inspect stays quick on small images
    try:
        pick = np.random.default_rng(seed).choice(len(reader), size=min(sample, len(reader)), replace=False)
        blobs = [reader.get(int(i)) for i in sorted(pick)]
        options = reader.metas[0].header["options"]
    finally:
        reader.close()
    long_sides = [max(image_size(b)) for b in blobs]
    median_long = int(statistics.median(long_sides)) if long_sides else 0
    max_side = recommended_max_side(size)
    advice = MaxSideAdvice(store=str(Path(store)), size=size, sampled=len(blobs), median_long_side=median_long,
                           max_side=max_side)
    if not blobs or median_long < FAR_LARGER * max_side:
        return advice
    from fastload.load.transforms import train_transform
    from fastload.measure.rounds import interleave
    from fastload.measure.timing import one_torch_thread, preset_ms_per_image

    # the same call convert would make with --max-side, under the store's own options
    reduced = [prepare(b, max_side=max_side, encoding=options.get("encoding", "jpeg"),
                       max_pixels=options["max_pixels"]).data for b in blobs]
    transform = train_transform(size)
    data = {"stored": blobs, "reduced": reduced}
    with one_torch_thread():
        preset_ms_per_image(transform, blobs[:1], seed)  # first-call costs (imports, allocators) off the clock
        preset_ms_per_image(transform, reduced[:1], seed)
        arms = interleave(list(data), rounds, lambda arm, r: preset_ms_per_image(transform, data[arm], seed + r))
    ms_stored, ms_reduced = arms["stored"].median(), arms["reduced"].median()
    return MaxSideAdvice(**{**asdict(advice), "speedup": round(ms_stored / ms_reduced, 2),
                            "ms_stored": round(ms_stored, 3), "ms_reduced": round(ms_reduced, 3),
                            "bytes_ratio": round(sum(map(len, reduced)) / sum(map(len, blobs)), 4),
                            "rounds": rounds})
