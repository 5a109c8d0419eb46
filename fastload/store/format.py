"""The on-disk contract of a fastload LMDB store, and nothing else.

Owns: the format version, the key scheme, how the metadata record and the chunk records
are laid out (as typed values: ``StoreMeta``, ``ChunkRecord``), and the shard naming.
Pure: no open handles, no I/O state (``reader.py`` keeps the handles, ``writer.py``
writes).

Layout of one store (an LMDB environment directory):

* ``SAMPLE_KEY(i)`` = ``i`` as 8 bytes big-endian → the encoded image bytes exactly as
  stored (JPEG or PNG). Fixed width, so LMDB's byte order is sample order.
* ``~build`` → JSON written by the first transaction of a conversion: format version,
  source fingerprint and the options. Lets a rerun resume, and refuses to mix sources.
* ``~chunk/<8-byte n>`` → JSON for each committed chunk: what it consumed from the source,
  and per sample its label, checksum, encoding and why it was canonicalised. Deleted when the
  store is finished.
* ``~meta`` → JSON header, plus ``~meta/<name>`` → one ``.npy`` array each (labels,
  crc32, encoding, stored_as) and ``~meta/paths`` (NUL-joined UTF-8 relative paths).
  Written **last**, in one transaction with the deletion of the chunk records: a store
  without ``~meta`` is incomplete, never silently short.

Sharded conversions write ``<dst>/shard-<i>-of-<k>/`` stores; a directory holding every
shard of one conversion reads as one store (shard 0's samples first).

Must not: open LMDB, decode images or know about torch.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fastload.errors import IncompleteStoreError, NotAStoreError

FORMAT_NAME = "fastload-lmdb"
FORMAT_VERSION = 1

BUILD_KEY = b"~build"
META_KEY = b"~meta"
CHUNK_PREFIX = b"~chunk/"
META_ARRAYS = ("labels", "crc32", "encoding", "stored_as")
PATHS_KEY = b"~meta/paths"

#: ``encoding`` codes: what kind of bytes a record holds.
ENCODINGS = ("jpeg", "png")
#: ``stored_as`` codes: original bytes, canonicalised for decoder agreement, re-encoded on request.
STORED_AS = ("original", "canonicalised", "reencoded")

_SHARD_RE = re.compile(r"^shard-(\d{5})-of-(\d{5})$")


def sample_key(index: int) -> bytes:
    """The LMDB key of sample ``index``."""
    return index.to_bytes(8, "big")


@dataclass(kw_only=True)
class ChunkRecord:
    """One committed chunk (``~chunk/<n>``): what it consumed from the source and, per stored
    sample, its label, checksum, encoding, how it was stored and why, and its relative path."""

    n: int
    consumed: int = 0
    stored: int = 0
    bytes: int = 0
    fp: str = ""
    labels: list[int] = field(default_factory=list)
    crc32: list[int] = field(default_factory=list)
    encoding: list[str] = field(default_factory=list)
    stored_as: list[str] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)

    def add(self, *, label: int, crc32: int, encoding: str, stored_as: str, reason: str | None, path: str,
            nbytes: int) -> None:
        self.stored += 1
        self.bytes += nbytes
        self.labels.append(label)
        self.crc32.append(crc32)
        self.encoding.append(encoding)
        self.stored_as.append(stored_as)
        self.reasons.append(reason)
        self.paths.append(path)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> ChunkRecord:
        return cls(**json.loads(data))


def chunk_key(n: int) -> bytes:
    return CHUNK_PREFIX + n.to_bytes(8, "big")


def array_key(name: str) -> bytes:
    return b"~meta/" + name.encode()


def shard_dirname(index: int, count: int) -> str:
    return f"shard-{index:05d}-of-{count:05d}"


def encode_array(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


def decode_array(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(bytes(data)), allow_pickle=False)


def encode_paths(paths: list[str]) -> bytes:
    return "\0".join(paths).encode("utf-8")


def decode_paths(data: bytes, count: int) -> list[str]:
    if count == 0:
        return []
    return bytes(data).decode("utf-8").split("\0")


@dataclass(frozen=True)
class StoreMeta:
    """What a complete store says about itself (one store or one shard)."""

    path: Path
    header: dict[str, Any]
    labels: np.ndarray
    crc32: np.ndarray
    encoding: np.ndarray
    stored_as: np.ndarray
    paths: list[str]

    @property
    def count(self) -> int:
        return int(self.header["count"])

    @property
    def classes(self) -> list[str]:
        return list(self.header["classes"])


def is_store_dir(path: Path) -> bool:
    return (path / "data.mdb").is_file()


def find_shards(path: Path) -> list[Path]:
    """Shard stores directly below ``path``, in shard order; [] when there are none."""
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if p.is_dir() and _SHARD_RE.match(p.name))


def check_shard_set(path: Path, shards: list[Path]) -> None:
    """Refuse a shard directory with shards missing or from different shard counts."""
    counts = {int(_SHARD_RE.match(p.name).group(2)) for p in shards}  # type: ignore[union-attr]
    if len(counts) != 1:
        raise NotAStoreError(f"{path}: shards from different --num-shards values: {sorted(counts)}")
    (k,) = counts
    have = {int(_SHARD_RE.match(p.name).group(1)) for p in shards}  # type: ignore[union-attr]
    missing = sorted(set(range(k)) - have)
    if missing:
        raise IncompleteStoreError(
            f"{path}: {len(missing)} of {k} shards are missing: "
            + ", ".join(shard_dirname(i, k) for i in missing[:10])
            + "\nHINT: run `fastload convert ... --num-shards "
            f"{k} --shard-index I` for each missing shard I."
        )


