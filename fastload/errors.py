"""Every exception fastload raises on purpose, in one tree.

::

    FastloadError                      base of everything below; catch this to catch all
    ├── StoreError                     a path is not a usable store
    │   ├── NotAStoreError             no LMDB store (or shard set) at that path
    │   ├── IncompleteStoreError       conversion never finished (metadata record missing)
    │   ├── StoreVersionError          written by a newer fastload format version
    │   └── ChecksumError              a record's bytes do not match its checksum
    ├── ConvertError                   conversion cannot go on (source mismatch, disk full, bad file in --strict)
    ├── SourceError                    the input tree / file list is unusable (no images, bad label, missing file)
    ├── CorruptSampleError             one sample failed to decode; names store, index and relative path
    ├── TooManyCorruptSamplesError     on_error="skip" met too many failures in a row
    ├── RecipeError                    a recipe file is invalid; names the field and the valid choices
    ├── ProfileError                   `fastload profile` cannot run the command or it ran no loader steps
    ├── MissingDependencyError         an optional extra is not installed; says which pip command fixes it
    └── Overloaded                     the inference batcher's queue is full; retry later

Also a ``ValueError`` where noted (``CorruptSampleError``, ``RecipeError`` and ``SourceError``
inherit from it) so code that already catches ``ValueError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "FastloadError",
    "StoreError",
    "NotAStoreError",
    "IncompleteStoreError",
    "StoreVersionError",
    "ChecksumError",
    "ConvertError",
    "SourceError",
    "CorruptSampleError",
    "TooManyCorruptSamplesError",
    "RecipeError",
    "ProfileError",
    "MissingDependencyError",
    "Overloaded",
]


class FastloadError(Exception):
    """Base class of all fastload errors."""


class StoreError(FastloadError):
    """A path cannot be used as a fastload store."""


class NotAStoreError(StoreError):
    """No fastload LMDB store at that path."""


class IncompleteStoreError(StoreError):
    """The store has no metadata record: its conversion did not finish."""


class StoreVersionError(StoreError):
    """The store was written by a newer format version than this fastload reads."""


class ChecksumError(StoreError):
    """A stored record does not match its recorded checksum."""


class ConvertError(FastloadError):
    """Conversion cannot continue."""


class SourceError(FastloadError, ValueError):
    """The conversion source (image tree or file list) is unusable."""


class CorruptSampleError(FastloadError, ValueError):
    """A sample failed to decode. The message names the store, the index and the relative path."""

    def __init__(self, message: str, *, index: int | None = None, relpath: str | None = None) -> None:
        super().__init__(message)
        self.index = index
        self.relpath = relpath

    def __reduce__(self):  # survive the trip from a DataLoader worker to the main process
        return (_rebuild_corrupt, (self.args[0], self.index, self.relpath))


def _rebuild_corrupt(message: str, index: int | None, relpath: str | None) -> CorruptSampleError:
    return CorruptSampleError(message, index=index, relpath=relpath)


class TooManyCorruptSamplesError(FastloadError, RuntimeError):
    """``on_error="skip"`` met more consecutive failures than it allows."""


class RecipeError(FastloadError, ValueError):
    """A recipe is invalid. The message names the field and the valid choices."""


class ProfileError(FastloadError):
    """``fastload profile`` / ``fastload.profile()`` could not measure: no command, or no loader steps."""


class MissingDependencyError(FastloadError, ImportError):
    """An optional dependency is missing; the message holds the pip command that installs it."""


class Overloaded(FastloadError):
    """The inference queue is full. Retry later (HTTP 503 with Retry-After)."""
