"""Every exception fastload raises on purpose, in one tree.

::

    FastloadError                      base of everything below; catch this to catch all
    ├── StoreError                     a path is not a usable store
    │   ├── NotAStoreError             no LMDB store (or shard set) at that path
    │   ├── IncompleteStoreError       conversion never finished (metadata record missing)
    │   ├── StoreVersionError          written by another fastload format version
    │   ├── StoreDamagedError          metadata or LMDB file damaged (checksum, truncated copy, LMDB error)
    │   │   └── StoreChangedError      its data.mdb was rewritten or replaced while it was being read
    │   ├── ChecksumError              a record's bytes do not match its checksum (also a CorruptSampleError)
    │   ├── ManifestError              a sharded store's manifest.json is unreadable or invalid
    │   ├── RemoteStoreError           an object-store operation failed (names the URL: credentials,
    │   │                              missing bucket or object, unreachable endpoint)
    │   └── ShardCacheError            the node's shard cache cannot provide a shard of a remote store
    │       ├── ShardIntegrityError    a downloaded shard's size or sha256 is not the manifest's (never used)
    │       └── CacheFullError         no room within cache_limit (all shards open), or the cache disk is full
    ├── ConvertError                   conversion cannot go on (source mismatch, disk full, bad file in --strict)
    │   └── StoreLockedError           another conversion is writing the same destination
    ├── SourceError                    the input tree / file list is unusable (no images, bad label, missing file)
    ├── CorruptSampleError             one sample failed to decode; names store, index and relative path
    ├── TooManyCorruptSamplesError     on_error="skip" met too many failures in a row
    ├── RecipeError                    a recipe file is invalid; names the field and the valid choices
    ├── ProfileError                   `fastload profile` cannot run the command or it ran no loader steps
    ├── MissingDependencyError         an optional extra is not installed; says which pip command fixes it
    ├── WorkerStartError               loader worker processes could not start (e.g. no __main__ guard)
    ├── SharedMemoryError              /dev/shm is too small for the DataLoader workers' batches in flight
    ├── ResumeStateError               a loader state cannot be loaded here (corrupt, or another dataset/seed/setup)
    ├── Overloaded                     the inference batcher's queue is full; retry later
    ├── ServeError                     the serving configuration is invalid (model, weights, devices)
    ├── DeadlineExceeded               an inference request outlived its deadline (HTTP 504)
    └── DeviceFailure                  the model failed on a batch (CUDA error, out of memory); the
                                       serving replica is marked unhealthy and the batch retried once

Also a ``ValueError`` where noted (``CorruptSampleError``, ``RecipeError``, ``ResumeStateError`` and ``SourceError``
inherit from it) so code that already catches ``ValueError`` keeps working.

Must not: import anything from fastload (every room, the edges included, raises these).
"""

from __future__ import annotations

__all__ = [
    "FastloadError",
    "StoreError",
    "NotAStoreError",
    "IncompleteStoreError",
    "StoreVersionError",
    "StoreDamagedError",
    "StoreChangedError",
    "ChecksumError",
    "ManifestError",
    "RemoteStoreError",
    "ShardCacheError",
    "ShardIntegrityError",
    "CacheFullError",
    "ConvertError",
    "StoreLockedError",
    "SourceReadError",
    "SourceError",
    "CorruptSampleError",
    "TooManyCorruptSamplesError",
    "RecipeError",
    "ProfileError",
    "MissingDependencyError",
    "WorkerStartError",
    "SharedMemoryError",
    "ResumeStateError",
    "Overloaded",
    "ServeError",
    "DeadlineExceeded",
    "DeviceFailure",
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


class StoreDamagedError(StoreError):
    """Part of a store is damaged: metadata fails its checksum, the LMDB file is short or corrupt."""


class ShardCacheError(StoreError):
    """The node-local shard cache (``store/cache.py``) cannot provide a shard of a remote store."""


class ShardIntegrityError(ShardCacheError):
    """A downloaded shard is not what the manifest says (size or sha256); it was deleted, never read."""


class CacheFullError(ShardCacheError):
    """The shard cache has no room: ``cache_limit`` is held by shards readers have open, or the disk is full."""


class StoreChangedError(StoreDamagedError):
    """A store's data.mdb changed (size, inode or modification time) while a reader had it open."""


class ConvertError(FastloadError):
    """Conversion cannot continue."""


class SourceReadError(ConvertError):
    """A source file could not be read (object-store or disk I/O), as opposed to being a bad image:
    the shard (or run) fails without publishing, so a retry or a rerun reads the file again."""


class StoreLockedError(ConvertError):
    """Another conversion (its pid and host are in the message) is writing the same destination."""


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


def _rebuild_corrupt(message: str, index: int | None, relpath: str | None, cls: type | None = None):
    return (cls or CorruptSampleError)(message, index=index, relpath=relpath)


class ChecksumError(CorruptSampleError, StoreError):
    """A record's bytes do not match the checksum stored for it (bit rot, a bad copy, tampering).

    A ``CorruptSampleError``, so ``on_error="skip"`` skips it like any bad sample.
    """

    def __reduce__(self):
        return (_rebuild_corrupt, (self.args[0], self.index, self.relpath, ChecksumError))


class ManifestError(StoreDamagedError):
    """A sharded store's ``manifest.json`` is not valid JSON or a field is missing or wrong (named)."""


class RemoteStoreError(StoreError):
    """An object-store operation failed. The message names the URL and what went wrong, with a HINT.

    ``reason`` is one of ``"credentials"``, ``"bucket"``, ``"missing"``, ``"endpoint"``, ``"other"``.
    """

    io_failure = True  # a read that failed is not a bad input (pool.TaskError.io): the work is redone

    def __init__(self, message: str, *, url: str = "", reason: str = "other") -> None:
        super().__init__(message)
        self.url = url
        self.reason = reason

    def __reduce__(self):  # survive the trip back from a Ray task or a worker process
        return (RemoteStoreError, (self.args[0],), {"url": self.url, "reason": self.reason})


class TooManyCorruptSamplesError(FastloadError, RuntimeError):
    """``on_error="skip"`` met more consecutive failures than it allows."""


class RecipeError(FastloadError, ValueError):
    """A recipe is invalid. The message names the field and the valid choices."""


class ProfileError(FastloadError):
    """``fastload profile`` / ``fastload.profile()`` could not measure: no command, or no loader steps.

    ``exit_status``: the profiled command's own exit status when it failed (``fastload profile`` exits with it).
    """

    def __init__(self, message: str = "", *, exit_status: int | None = None) -> None:
        super().__init__(message)
        self.exit_status = exit_status


class MissingDependencyError(FastloadError, ImportError):
    """An optional dependency is missing; the message holds the pip command that installs it."""


class WorkerStartError(FastloadError, RuntimeError):
    """Worker processes of a loader could not start; the message says why and how to fix it."""


class SharedMemoryError(FastloadError, RuntimeError):
    """``/dev/shm`` cannot hold the batches worker processes would have in flight (a "Bus error" otherwise)."""


class ResumeStateError(FastloadError, ValueError):
    """A loader state (``load_state_dict``) is corrupt or was saved for another dataset, seed or setup.

    The message names the field that differs, the saved and the current value.
    """


class Overloaded(FastloadError):
    """The inference queue is full. Retry later (HTTP 503 with Retry-After)."""


class ServeError(FastloadError, ValueError):
    """``fastload serve`` cannot start as configured (unknown model, weights that do not fit, bad devices)."""


class DeadlineExceeded(FastloadError, TimeoutError):
    """An inference request was not answered before its deadline (HTTP 504); it left the queue."""


class DeviceFailure(FastloadError, RuntimeError):
    """The model failed on a batch on one device (CUDA error, out of memory, a broken replica)."""
