"""The one skip policy of every reader of a store: ``on_error="raise" | "skip"``, bounded and counted.

Owns: the valid ``on_error`` values, the bound (more than ``MAX_CONSECUTIVE_SKIPS`` failures in
a row raise ``TooManyCorruptSamplesError``: a store that damaged is not "a few bad files"),
the log line of each skipped sample, and the error's wording. ``LMDBImageDataset`` and
``DALILoader`` both call it; each keeps its own ``skipped`` count (per process) and decides
what replaces a skipped sample.

Must not: read stores or decode; choose the replacement sample.
"""

from __future__ import annotations

import logging

from fastload.errors import CorruptSampleError, TooManyCorruptSamplesError

__all__ = ["ON_ERROR", "MAX_CONSECUTIVE_SKIPS", "check_on_error", "record_skip"]

log = logging.getLogger("fastload")
ON_ERROR = ("raise", "skip")
MAX_CONSECUTIVE_SKIPS = 20  # timm's bound: past it the data is broken, not unlucky


def check_on_error(on_error: str) -> None:
    """Raise ``ValueError`` unless ``on_error`` is one of ``ON_ERROR``."""
    if on_error not in ON_ERROR:
        raise ValueError(f"Unknown value {on_error!r} for argument on_error. Valid values are "
                         + ", ".join(repr(v) for v in ON_ERROR) + ".")


def record_skip(source: object, exc: CorruptSampleError, *, skipped: int, run: int, where: str) -> None:
    """Log one skipped sample; raise when ``run`` failures in a row pass the bound.

    Args:
        source: the store (or folder) read, named in the error.
        exc: the sample's error (it names the index and relative path).
        skipped: samples skipped so far by this reader in this process, this one included.
        run: failures in a row, this one included.
        where: where the run happened, e.g. ``"from index 40"`` or ``"near batch 3 of epoch 0"``.

    Raises:
        TooManyCorruptSamplesError: ``run`` is above ``MAX_CONSECUTIVE_SKIPS``.
    """
    log.warning("skipping %s (skipped %d so far in this process)", exc.args[0].splitlines()[0], skipped)
    if run > MAX_CONSECUTIVE_SKIPS:
        raise TooManyCorruptSamplesError(
            f"{source}: {run} consecutive samples failed {where} (more than {MAX_CONSECUTIVE_SKIPS} in a row); "
            f"the store looks damaged.\nHINT: run `fastload verify {source}`.") from exc
