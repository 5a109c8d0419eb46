"""Progress bars that suit both a terminal and a log file.

An edge module (like ``system.py``): any room may use it. On a terminal, tqdm redraws one
line in place a few times a second. Written to a file or a CI log, the same bar becomes
thousands of carriage-return updates on one line (a quickstart log was 40 KB of them), so
when the stream is not a TTY the bar updates at most every ``LOG_INTERVAL_S`` seconds and
never resizes itself.

Must not: import torch or anything outside the standard library and tqdm.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

__all__ = ["LOG_INTERVAL_S", "bar", "is_terminal"]

#: Seconds between updates when the stream is not a terminal (tqdm's ``mininterval``).
LOG_INTERVAL_S = 15.0


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default: stderr, where tqdm writes) is a terminal."""
    stream = stream if stream is not None else sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def bar(*, total: int | None = None, desc: str | None = None, disable: bool = False,
        file: TextIO | None = None, **kwargs: Any):
    """A ``tqdm`` bar with the settings for where it is written (extra ``kwargs`` go to tqdm)."""
    from tqdm import tqdm

    stream = file if file is not None else sys.stderr
    if is_terminal(stream):
        settings: dict[str, Any] = {"dynamic_ncols": True}
    else:
        settings = {"mininterval": LOG_INTERVAL_S, "maxinterval": LOG_INTERVAL_S * 4, "ncols": 100,
                    "ascii": True}
    settings.update(kwargs)
    return tqdm(total=total, desc=desc, disable=disable, file=stream, **settings)
