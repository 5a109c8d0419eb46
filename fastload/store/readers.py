"""The one reader seam: the ``Reader`` Protocol every store reader keeps, and the scheme table that
opens one for a path or URL.

Owns: what a loader may ask of a store (its length, classes, bytes, labels, relative paths,
shard sizes, its sample index, background shard prefetch) and what it declares about itself
(``shard_ordered``: read shard by shard, so a loader picks a shard-ordered sampler); the
``ReaderOptions`` every reader is opened with; the table from URL scheme to reader
(``register_scheme``, ``open_store_reader``): a local path opens ``reader.StoreReader``,
``s3://``, ``gs://``, ``az://`` (and their aliases) open ``remote_store.RemoteStoreReader``.

A new storage scheme is one reader keeping ``Reader`` and one ``register_scheme`` call, in this
room: the dataset, the loaders and the samplers above read it unchanged.

Must not: read records itself, or import torch (DALI's spawned workers unpickle readers).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from fastload.store.remote import SCHEMES, is_remote

__all__ = ["Reader", "ReaderOptions", "register_scheme", "open_store_reader", "is_store_url"]


@runtime_checkable
class Reader(Protocol):
    """What every store reader offers a dataset or a loader (``StoreReader``, ``RemoteStoreReader``)."""

    #: True: a shard is fetched whole before any of its records is read (object storage through the
    #: node cache), so a random order over all samples would fetch every shard at once; a loader
    #: reads such a store in shard order (``load.shards.ShardSampler``). False: random reads are cheap.
    shard_ordered: bool
    classes: list[str]

    def __len__(self) -> int: ...

    @property
    def shard_sizes(self) -> list[int]:
        """Samples per shard, in store order (one entry for a single store)."""
        ...

    def get(self, index: int, *, verify: bool | None = None) -> bytes:
        """The record's bytes exactly as stored, checked against its crc32."""
        ...

    def label(self, index: int) -> int: ...

    def relpath(self, index: int) -> str: ...

    def sample_index(self) -> tuple[Sequence[int], Sequence[str]] | None:
        """Every label and relative path, when the reader has them without reading every shard."""
        ...

    def prefetch_shards(self, shards: list[int]) -> None:
        """Start fetching these shards in the background (nothing where there is nothing to fetch)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class ReaderOptions:
    """How a reader is opened.

    Args:
        readahead: a local store: OS readahead on the memory map (``reader.open_readonly``).
        cache_dir: a URL: the node's shard cache folder (default ``remote_store.default_cache_dir()``).
        cache_limit: a URL: the bytes that cache may hold (``"20GB"``; default no limit).
        open_shards: a URL: the most shards one process keeps leased (default: the reader's own).
    """

    readahead: bool = False
    cache_dir: str | os.PathLike[str] | None = None
    cache_limit: int | str | None = None
    open_shards: int | None = None


Opener = Callable[[str, ReaderOptions], Reader]

_OPENERS: dict[str, Opener] = {}
_SCHEME = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://")


def register_scheme(scheme: str, opener: Opener) -> None:
    """Open ``scheme://...`` paths with ``opener(url, options)`` from now on (in this process; a
    worker process that imports the module registering it has it too)."""
    if not _SCHEME.fullmatch(f"{scheme}://"):
        raise ValueError(f"{scheme!r} is not a URL scheme (letters, digits, '+', '-', '.'; a letter first)")
    _OPENERS[scheme] = opener


def _scheme(path: str) -> str | None:
    m = _SCHEME.match(path)
    return m.group("scheme") if m and m.group("scheme") in _OPENERS else None


def is_store_url(path: object) -> bool:
    """True for a URL of a registered scheme; False for a local path. Raises ``RemoteStoreError`` for a
    string that looks like a URL of no registered scheme (``store.remote.is_remote`` says which exist)."""
    return _scheme(str(path)) is not None or is_remote(path)


def open_store_reader(path: str | os.PathLike[str], options: ReaderOptions = ReaderOptions()) -> Reader:
    """The reader for ``path``: a local store or folder of shards, or the URL of a sharded store.

    Raises:
        NotAStoreError, IncompleteStoreError, StoreVersionError, ManifestError, RemoteStoreError: as
            the reader it opens; ValueError: cache options given for a local store.
    """
    text = str(path)
    scheme = _scheme(text)
    if scheme is not None:
        return _OPENERS[scheme](text, options)
    is_remote(text)  # a URL of no known scheme is refused here, never taken for a folder
    return _open_local(text, options)


def _open_local(path: str, options: ReaderOptions) -> Reader:
    from fastload.store.reader import StoreReader

    if options.cache_dir is not None or options.cache_limit is not None:
        raise ValueError(f"{path}: cache_dir and cache_limit are for stores in object storage "
                         "(s3://, gs://, az://); a local store is read in place.")
    return StoreReader(path, readahead=options.readahead)


def _open_remote(url: str, options: ReaderOptions) -> Reader:
    from fastload.store.remote_store import RemoteStoreReader

    extra = {} if options.open_shards is None else {"open_shards": options.open_shards}
    return RemoteStoreReader(url, cache_dir=options.cache_dir, cache_limit=options.cache_limit, **extra)


for _s in SCHEMES:
    register_scheme(_s, _open_remote)
