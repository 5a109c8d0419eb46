"""The on-disk contract of a fastload LMDB store, and nothing else.

Owns: the format version, the key scheme, how the metadata record is laid out and read
back, and the checks every reader makes before trusting a store.

Layout of one store (an LMDB environment directory):

* ``SAMPLE_KEY(i)`` = ``i`` as 8 bytes big-endian → the encoded image bytes exactly as
  stored (JPEG or PNG). Fixed width, so LMDB's byte order is sample order.
* ``~build`` → JSON written by the first transaction of a conversion: format version,
  source fingerprint and the options. Lets a rerun resume, and refuses to mix sources.
* ``~chunk/<8-byte n>`` → JSON for each committed chunk: what it consumed from the source,
  and per sample its label, checksum, encoding and why it was normalised. Deleted when the
  store is finished.
* ``~meta`` → JSON header, plus ``~meta/<name>`` → one ``.npy`` array each (labels,
  crc32, encoding, stored_as) and ``~meta/paths`` (NUL-joined UTF-8 relative paths).
  Written **last**, in one transaction with the deletion of the chunk records: a store
  without ``~meta`` is incomplete, never silently short.

Sharded conversions write ``<dst>/shard-<i>-of-<k>/`` stores; a directory holding every
shard of one conversion reads as one store (shard 0's samples first).

Must not: decode images or know about torch.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastload.errors import IncompleteStoreError, NotAStoreError, StoreVersionError

FORMAT_NAME = "fastload-lmdb"
FORMAT_VERSION = 1

BUILD_KEY = b"~build"
META_KEY = b"~meta"
CHUNK_PREFIX = b"~chunk/"
META_ARRAYS = ("labels", "crc32", "encoding", "stored_as")
PATHS_KEY = b"~meta/paths"

#: ``encoding`` codes: what kind of bytes a record holds.
ENCODINGS = ("jpeg", "png")
#: ``stored_as`` codes: original bytes, normalised for decoder agreement, re-encoded on request.
STORED_AS = ("original", "normalised", "reencoded")

_SHARD_RE = re.compile(r"^shard-(\d{5})-of-(\d{5})$")


def sample_key(index: int) -> bytes:
    """The LMDB key of sample ``index``."""
    return index.to_bytes(8, "big")


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


_ENVS: dict[str, tuple[int, Any]] = {}
_ENVS_LOCK = threading.Lock()


def open_env_readonly(path: Path, *, readahead: bool = False):
    """The process-wide read-only environment of one store (``readonly=True, lock=False``).

    LMDB allows one open of an environment per process (py-lmdb refuses a second), so
    every reader in a process shares one handle per store, opened on first use. Handles
    inherited through ``fork`` belong to the parent and are never used: the child opens
    its own. ``readahead=False`` by default: OS readahead makes random reads of a store
    larger than RAM pull in pages that are never used (README, "Readahead"); the first
    open in a process decides it.
    """
    key = os.path.realpath(path)
    hit = _ENVS.get(key)
    if hit is not None and hit[0] == os.getpid():
        return hit[1]
    return _open_env(Path(path), key, readahead)


def _lmdb_open(path: Path, readahead: bool):
    import lmdb

    if not path.exists():
        raise NotAStoreError(f"{path} does not exist.\nHINT: create a store with `fastload convert SRC {path}`.")
    if not is_store_dir(path):
        raise NotAStoreError(
            f"{path} is not a fastload store (no data.mdb inside).\n"
            f"HINT: create one with `fastload convert SRC {path}`."
        )
    try:
        return lmdb.open(str(path), readonly=True, lock=False, readahead=readahead,
                         max_readers=2048, subdir=True, meminit=False, max_spare_txns=2)
    except lmdb.Error as exc:
        raise NotAStoreError(f"{path}: cannot open as LMDB: {exc}") from exc


def _open_env(path: Path, key: str, readahead: bool):
    with _ENVS_LOCK:
        hit = _ENVS.get(key)
        if hit is not None and hit[0] == os.getpid():
            return hit[1]
        if hit is not None:
            # Inherited through fork. py-lmdb still counts it as open in this process and
            # refuses a new open until it is closed; closing the child's copy (lock=False:
            # no lock file, no shared reader slot) leaves the parent's handle untouched.
            hit[1].close()
        env = _lmdb_open(path, readahead)
        _ENVS[key] = (os.getpid(), env)
        return env


@contextlib.contextmanager
def _env_briefly(path: Path):
    """This process's shared handle if it has one, else a handle closed again on exit."""
    hit = _ENVS.get(os.path.realpath(path))
    if hit is not None and hit[0] == os.getpid():
        yield hit[1]
        return
    env = _lmdb_open(path, False)
    try:
        yield env
    finally:
        env.close()


def release_env(path: Path) -> None:
    """Close this process's read handle on ``path`` (before writing to it); reopened on next use."""
    with _ENVS_LOCK:
        hit = _ENVS.pop(os.path.realpath(path), None)
    if hit is not None and hit[0] == os.getpid():
        hit[1].close()


def read_meta(env, path: Path) -> StoreMeta:
    """Read and check the metadata of an open store; raise a clear error if it is unusable."""
    with env.begin(buffers=False) as txn:
        raw = txn.get(META_KEY)
        if raw is None:
            build = txn.get(BUILD_KEY)
            if build is None:
                raise NotAStoreError(f"{path} is an LMDB environment but not a fastload store (no ~meta record).")
            done = sum(json.loads(v)["stored"] for k, v in txn.cursor() if k.startswith(CHUNK_PREFIX))
            raise IncompleteStoreError(
                f"{path} is incomplete: its conversion stopped after {done} samples and never "
                "wrote the metadata record.\nHINT: rerun the same `fastload convert` command to "
                "resume it; it continues where it stopped."
            )
        header = json.loads(raw)
        if header.get("format") != FORMAT_NAME:
            raise NotAStoreError(f"{path}: unknown store format {header.get('format')!r}.")
        if int(header.get("version", 0)) > FORMAT_VERSION:
            raise StoreVersionError(
                f"{path} was written with store format version {header['version']}; this fastload "
                f"reads versions up to {FORMAT_VERSION}.\nHINT: pip install --upgrade fastload"
            )
        arrays = {name: decode_array(txn.get(array_key(name))) for name in META_ARRAYS}
        paths = decode_paths(txn.get(PATHS_KEY), int(header["count"]))
    return StoreMeta(path=path, header=header, paths=paths, **arrays)


def load_store_metas(path: str | os.PathLike[str]) -> list[StoreMeta]:
    """Metadata of the store at ``path``: one entry, or one per shard of a shard directory."""
    path = Path(path)
    shards = [] if is_store_dir(path) else find_shards(path)
    if shards:
        check_shard_set(path, shards)
    metas = []
    for p in shards or [path]:
        with _env_briefly(p) as env:  # constructors open nothing that outlives them
            metas.append(read_meta(env, p))
    if len(metas) > 1:
        first = metas[0]
        for m in metas[1:]:
            same_source = m.header["source"]["fingerprint"] == first.header["source"]["fingerprint"]
            if m.classes != first.classes or not same_source:
                raise NotAStoreError(
                    f"{path}: {m.path.name} was converted from a different source than {first.path.name}.")
    return metas
