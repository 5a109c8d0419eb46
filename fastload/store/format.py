"""The on-disk contract of a fastload LMDB store, and nothing else.

Owns: the format version, the key scheme, how the metadata record and the chunk records
are laid out (as typed values: ``StoreMeta``, ``ChunkRecord``), and the shard naming.
Pure: no open handles, no I/O state (``reader.py`` keeps the handles, ``writer.py``
writes).

Layout of one store (an LMDB environment directory):

* ``SAMPLE_KEY(i)`` = ``i`` as 8 bytes big-endian → the image bytes exactly as stored
  (JPEG, PNG, or raw RGB pixels as a binary PPM: ``P6`` header + HWC bytes). Fixed width,
  so LMDB's byte order is sample order.
* ``~build`` → JSON written by the first transaction of a conversion: format version,
  source fingerprint and the options. Lets a rerun resume, and refuses to mix sources.
* ``~chunk/<8-byte n>`` → JSON for each committed chunk: what it consumed from the source,
  and per sample its label, checksum, encoding and why it was canonicalised or re-encoded,
  the PSNR of its lossy writes, and per file (stored or skipped) what was repaired so that
  Pillow reads it (``salvaged``) and what the decoders warned about (``decoder_warnings``),
  so that a resumed conversion reports the files of the run that was killed too (records
  written before those fields existed read as having none). Deleted when the store is finished.
* ``~meta`` → JSON header, plus ``~meta/<name>`` → one ``.npy`` array each (labels,
  crc32, encoding, stored_as) and ``~meta/paths`` (NUL-joined relative paths, UTF-8;
  names that are not valid UTF-8 are kept byte for byte with ``surrogateescape``). The
  header counts samples by encoding and by how they were stored, with the reasons, and
  sums up the fidelity of lossy writes (``lossy``: count, minimum and median PSNR, and
  ``psnr_hist``, how many writes had each PSNR value, so that the median of several shards
  together is exact: ``lossy_summary``; headers written before it lack the histogram).
  Written **last**, in one transaction with the deletion of the chunk records: a store
  without ``~meta`` is incomplete, never silently short.
* Integrity (format 2): the header holds the crc32 of every array and of the paths, and
  ``~meta-check`` holds the crc32 of the header bytes, so any damage to the metadata is
  found when a store is opened (``parse_meta``); every record's crc32 is in the
  ``crc32`` array and is checked on every read (``reader.py``).

Sharded conversions write ``<dst>/shard-<i>-of-<k>/`` stores; a directory holding every
shard of one conversion reads as one store (shard 0's samples first).

Must not: open LMDB, decode images or know about torch.
"""

from __future__ import annotations

import io
import json
import re
import zlib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from fastload.errors import IncompleteStoreError, NotAStoreError, StoreDamagedError, StoreVersionError

FORMAT_NAME = "fastload-lmdb"
FORMAT_VERSION = 2

BUILD_KEY = b"~build"
META_KEY = b"~meta"
CHUNK_PREFIX = b"~chunk/"
#: The writer lock beside a store being written (its text: who holds it).
LOCK_NAME = ".fastload-writer.lock"
META_ARRAYS = ("labels", "crc32", "encoding", "stored_as")
PATHS_KEY = b"~meta/paths"
META_CHECK_KEY = b"~meta-check"
_ARRAY_DTYPES = {"labels": np.int64, "crc32": np.uint32, "encoding": np.uint8, "stored_as": np.uint8}

#: ``encoding`` codes: what kind of bytes a record holds.
ENCODINGS = ("jpeg", "png", "raw")
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
    psnr: list[float] = field(default_factory=list)  # of the lossy writes in this chunk, in dB
    #: files stored after a repair Pillow needs: ``{"relpath", "what"}`` (absent in older records)
    salvaged: list[dict[str, str]] = field(default_factory=list)
    #: decoder (Pillow) warnings per file, stored or skipped: ``{"relpath", "warnings": [...]}``
    decoder_warnings: list[dict[str, Any]] = field(default_factory=list)

    def add(self, *, label: int, crc32: int, encoding: str, stored_as: str, reason: str | None, path: str,
            nbytes: int, psnr: float | None = None) -> None:
        self.stored += 1
        self.bytes += nbytes
        self.labels.append(label)
        self.crc32.append(crc32)
        self.encoding.append(encoding)
        self.stored_as.append(stored_as)
        self.reasons.append(reason)
        self.paths.append(path)
        if psnr is not None:
            self.psnr.append(psnr)

    def note(self, *, path: str, salvaged: str | None, warnings: tuple[str, ...] | list[str]) -> None:
        """Record what a worker said about one file besides the verdict (a repair, decoder warnings)."""
        if salvaged:
            self.salvaged.append({"relpath": path, "what": salvaged})
        if warnings:
            self.decoder_warnings.append({"relpath": path, "warnings": list(warnings)})

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> ChunkRecord:
        known = {f.name for f in fields(cls)}  # a later version's extra fields are not ours to read
        return cls(**{k: v for k, v in json.loads(data).items() if k in known})


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
    return "\0".join(paths).encode("utf-8", "surrogateescape")


def decode_paths(data: bytes, count: int) -> list[str]:
    if count == 0:
        return []
    return bytes(data).decode("utf-8", "surrogateescape").split("\0")


def crc_hex(data: bytes) -> str:
    return f"{zlib.crc32(data):08x}"


def lossy_summary(values: Any = (), *, headers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The ``lossy`` summary of a store's lossy writes: ``count``, ``psnr_min``, ``psnr_median`` and
    ``psnr_hist`` (each PSNR value, as ``repr`` of the float, to how many writes had it).

    From the PSNR ``values`` of one store's writes, or merged from the ``lossy`` summaries of several
    ``headers`` (the shards of one store): the median is then the median of every write of every shard,
    exactly as one store of all of them reports it. A header written before the histogram existed
    leaves the median unknown (``None``); count and minimum are still summed and taken.
    """
    hist: dict[float, int] = {}
    count, mins, only = 0, [], None
    if headers is None:
        vals = [float(v) for v in values]
        for v in vals:
            hist[v] = hist.get(v, 0) + 1
        count, mins = len(vals), vals
    else:
        for h in headers:
            lossy = h.get("lossy") or {}
            count += int(lossy.get("count", 0))
            if lossy.get("count"):
                only = lossy if only is None and count == lossy["count"] else {}  # the one header with writes
            if lossy.get("psnr_min") is not None:
                mins.append(float(lossy["psnr_min"]))
            for k, c in (lossy.get("psnr_hist") or {}).items():
                hist[float(k)] = hist.get(float(k), 0) + int(c)
    keys = sorted(hist)
    median = None
    if count and sum(hist.values()) == count:  # else a shard of an older fastload: no histogram
        cum = np.cumsum([hist[v] for v in keys])
        lo = keys[int(np.searchsorted(cum, (count - 1) // 2, side="right"))]  # the k-th smallest write, 0-based
        hi = keys[int(np.searchsorted(cum, count // 2, side="right"))]
        median = float(np.mean([lo, hi]))  # as np.median of the values
    elif only:  # the only header with lossy writes knows their median, histogram or not
        median = only.get("psnr_median")
    return {"count": count, "psnr_min": min(mins) if mins else None, "psnr_median": median,
            "psnr_hist": {repr(v): hist[v] for v in keys}}


def meta_records(header: dict[str, Any], arrays: dict[str, np.ndarray], paths: list[str]) -> list[tuple[bytes, bytes]]:
    """The metadata records of a finished store, checksummed (``header`` gains ``checksums``)."""
    blobs = {name: encode_array(arrays[name].astype(_ARRAY_DTYPES[name])) for name in META_ARRAYS}
    blobs["paths"] = encode_paths(paths)
    header = dict(header, checksums={name: crc_hex(b) for name, b in blobs.items()})
    raw = json.dumps(header, sort_keys=True).encode()
    puts = [(array_key(name), b) for name, b in blobs.items() if name != "paths"]
    return puts + [(PATHS_KEY, blobs["paths"]), (META_KEY, raw), (META_CHECK_KEY, crc_hex(raw).encode())]


def damaged(path: Path, what: str) -> StoreDamagedError:
    return StoreDamagedError(
        f"{path}: the store is damaged: {what}.\nHINT: run `fastload verify {path}` to see what else is "
        f"affected; a damaged store cannot be repaired: convert the source again into a new folder."
    )


def parse_meta(path: Path, raw: bytes, check: bytes | None, blobs: dict[str, bytes | None]) -> StoreMeta:
    """Check and decode the metadata records of one store (``blobs``: each array's and ``paths``' bytes).

    Raises:
        StoreDamagedError: any part is missing, fails its checksum or is inconsistent.
        NotAStoreError, StoreVersionError: another format, or a newer/older version.
    """
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise damaged(path, f"its metadata header is not valid JSON ({exc})") from None
    if header.get("format") != FORMAT_NAME:
        raise NotAStoreError(f"{path}: unknown store format {header.get('format')!r}.")
    version = header.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise StoreVersionError(
            f"{path} was written with store format version {version}; this fastload reads version "
            f"{FORMAT_VERSION}.\nHINT: pip install --upgrade fastload")
    if version < FORMAT_VERSION:
        raise StoreVersionError(
            f"{path} was written with store format version {version}, before records and metadata were "
            f"checksummed; this fastload reads version {FORMAT_VERSION}.\nHINT: convert the source again.")
    if check is None or bytes(check).decode("ascii", "replace") != crc_hex(raw):
        raise damaged(path, "its metadata header fails its checksum")
    try:
        count = int(header["count"])
        classes = header["classes"]
        sums = header["checksums"]
        if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes) or count < 0:
            raise ValueError("bad count or classes")
    except (KeyError, TypeError, ValueError) as exc:
        raise damaged(path, f"its metadata header lacks a valid field ({exc})") from None
    arrays: dict[str, np.ndarray] = {}
    for name in (*META_ARRAYS, "paths"):
        blob = blobs.get(name)
        if blob is None:
            raise damaged(path, f"its metadata record {name!r} is missing")
        if crc_hex(bytes(blob)) != sums.get(name):
            raise damaged(path, f"its metadata record {name!r} fails its checksum")
        if name == "paths":
            continue
        try:
            arr = decode_array(blob)
        except Exception as exc:
            raise damaged(path, f"its metadata array {name!r} cannot be read ({exc})") from None
        if arr.dtype != _ARRAY_DTYPES[name] or arr.shape != (count,):
            raise damaged(path, f"its metadata array {name!r} has {arr.dtype} {arr.shape}, expected ({count},)")
        arrays[name] = arr
    paths = decode_paths(blobs["paths"], count)  # type: ignore[arg-type]
    if len(paths) != count:
        raise damaged(path, f"it lists {len(paths)} relative paths for {count} samples")
    labels = arrays["labels"]
    if count and (labels.min() < 0 or labels.max() >= len(classes)):
        bad = int(np.flatnonzero((labels < 0) | (labels >= len(classes)))[0])
        raise damaged(path, f"sample {bad} has label {int(labels[bad])}, outside 0..{len(classes) - 1}")
    if count and (arrays["encoding"].max() >= len(ENCODINGS) or arrays["stored_as"].max() >= len(STORED_AS)):
        raise damaged(path, "its encoding codes are out of range")
    return StoreMeta(path=path, header=header, paths=paths, **arrays)


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


