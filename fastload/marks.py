"""Timed work marks itself: the ``timed`` decorator that readers, decoders and presets wear, and the
one hook a profiler sets to time what is marked.

Owns: the parts a sample's time is split into (``PARTS``: store read, decode, transform), the
registry of marked callables (``marked()``), and the hook: a marked callable calls the hook
when one is set (``instrument``), else itself and nothing more. A new preset, reader or decoder
that wears ``@timed(...)`` is in the profile's split with no change to the profiler.

Must not: import anything (every room may use it, the profiler's probe too), or time anything
itself: what a part means for a sample is the profiler's (``profiling/_samples.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["PARTS", "Mark", "timed", "marked", "instrument"]

#: What a sample's time is split into by marked work (the rest is "other" or "download").
PARTS = ("read", "decode", "transform")


@dataclass(frozen=True, kw_only=True)
class Mark:
    """What a marked callable is: its ``part``; ``own``: timed less the marked work inside it (a preset
    decodes inside its transform); ``per_class``: also counted under its instance's class name (presets)."""

    part: str
    own: bool = False
    per_class: bool = False
    qualname: str = ""


#: ``hook(mark, fn, args, kwargs)`` runs each marked call while a profiler has set it; None: no profiler.
Hook = Callable[[Mark, Callable[..., Any], tuple, dict], Any]

_HOOK: Hook | None = None
_MARKED: list[Mark] = []


def timed(part: str, *, own: bool = False, per_class: bool = False) -> Callable[[Callable], Callable]:
    """Mark a function or method as ``part`` of a sample's work (one of ``PARTS``)."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")

    def mark(fn: Callable) -> Callable:
        m = Mark(part=part, own=own, per_class=per_class,
                 qualname=f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}")
        _MARKED.append(m)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            hook = _HOOK
            if hook is None:
                return fn(*args, **kwargs)
            return hook(m, fn, args, kwargs)

        run.__fastload_mark__ = m  # type: ignore[attr-defined]
        return run

    return mark


def marked() -> list[Mark]:
    """Every callable marked so far in this process (in the modules imported so far)."""
    return list(_MARKED)


def instrument(hook: Hook | None) -> None:
    """Set (or, with None, clear) the one hook every marked call runs through, in this process."""
    global _HOOK
    _HOOK = hook
