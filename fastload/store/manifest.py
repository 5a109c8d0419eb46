"""The manifest of a sharded store: ``DST/manifest.json``, written **last**.

Owns: the typed manifest (``Manifest``, ``ShardEntry``), its JSON form and the validation of
every field, and the names of the files beside the shards. Pure, like ``format.py``: no I/O.

Layout of a sharded store, identical on a local disk and in a bucket::

    DST/plan.json                            what is being converted (source, options, shard plan);
                                             written first, so a rerun can resume or refuse
    DST/shard-IIIII-of-KKKKK/data.mdb        one complete, compacted LMDB store per shard
    DST/samples.json.gz                      every sample's label and relative path (format 2), so
                                             ``targets`` / ``samples`` cost one small GET, no shard
    DST/manifest.json                        written last: a DST without it is incomplete everywhere

Shard ``i`` holds the global samples ``[start, start + count)``; sample ``j`` of the store is
sample ``j - start`` of the shard that holds it. ``sha256`` and ``bytes`` are those of the
shard's ``data.mdb`` file, so a copy can be checked without opening LMDB.

Versions: 1 — shards, classes, options, counts. 2 — adds ``samples``: ``{"name":
"samples.json.gz", "bytes", "sha256", "count"}``, the object beside the manifest that holds
``{"labels": [...], "paths": [...]}`` for all samples in store order (gzip'd JSON, written
byte-identically whatever engine or worker count produced the shards: ``samples_object``).
A version-1 manifest has no ``samples``: readers then take labels and paths from the shards
(downloading them). The object is checked against its size and sha256 and its content
against the manifest (``parse_samples``) before any of it is used.

Must not: open files or talk to a network (``remote.py`` and ``pack/`` do).
"""

from __future__ import annotations

import bisect
import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from fastload.errors import ManifestError

__all__ = ["MANIFEST_NAME", "PLAN_NAME", "SHARD_FILE", "SAMPLES_NAME", "MANIFEST_VERSION", "ShardEntry",
           "SamplesEntry", "Manifest", "samples_object", "samples_limit", "parse_samples"]

MANIFEST_NAME = "manifest.json"
PLAN_NAME = "plan.json"
SHARD_FILE = "data.mdb"
SAMPLES_NAME = "samples.json.gz"
MANIFEST_VERSION = 2
_SHARD_NAME = re.compile(r"^shard-\d{5}-of-\d{5}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class ShardEntry:
    """One shard: its folder name, the global sample range it holds, its file's size and sha256."""

    name: str
    start: int
    count: int
    bytes: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "start": self.start, "count": self.count, "bytes": self.bytes,
                "sha256": self.sha256}


@dataclass(frozen=True)
class SamplesEntry:
    """The labels-and-paths object beside the manifest (format 2): its name, size, sha256, sample count."""

    name: str
    bytes: int
    sha256: str
    count: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.bytes, "sha256": self.sha256, "count": self.count}


@dataclass(frozen=True)
class Manifest:
    """What a complete sharded store holds.

    Attributes:
        format_version: ``MANIFEST_VERSION`` of the writer.
        shards: in order; their ranges tile ``0..num_samples`` without gap or overlap.
        classes: class names; labels index into it.
        num_samples: samples in all shards.
        options: the conversion's record options and its source (``options["source"]``).
        counts: the conversion report's counts (``stored``, ``skipped``, ``canonicalised``, ...).
        samples: the labels-and-paths object (format 2; None in a format-1 manifest).
    """

    format_version: int
    shards: tuple[ShardEntry, ...]
    classes: tuple[str, ...]
    num_samples: int
    options: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, Any] = field(default_factory=dict)
    samples: SamplesEntry | None = None

    def to_json(self) -> str:
        d = {"format_version": self.format_version, "num_samples": self.num_samples,
             "classes": list(self.classes), "shards": [s.to_json() for s in self.shards],
             "options": self.options, "counts": self.counts}
        if self.samples is not None:
            d["samples"] = self.samples.to_json()
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str = MANIFEST_NAME) -> Manifest:
        """Parse and check a manifest (``where``: its path or URL, for messages).

        Raises:
            ManifestError: not JSON, a field missing or of the wrong type, or shard ranges
                that do not tile ``0..num_samples``; the message names the field.
        """
        try:
            d = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _bad(where, f"it is not valid JSON ({exc})") from None
        if not isinstance(d, dict):
            raise _bad(where, "it is not a JSON object")
        version = _field(d, "format_version", int, where)
        if version > MANIFEST_VERSION or version < 1:
            raise _bad(where, f"format_version {version} is not one this fastload reads ({MANIFEST_VERSION})",
                       hint="pip install --upgrade fastload")
        num = _field(d, "num_samples", int, where)
        classes = _field(d, "classes", list, where)
        if not all(isinstance(c, str) for c in classes):
            raise _bad(where, "field 'classes' must be a list of strings")
        options = _field(d, "options", dict, where)
        counts = _field(d, "counts", dict, where)
        shards = []
        for i, s in enumerate(_field(d, "shards", list, where)):
            if not isinstance(s, dict):
                raise _bad(where, f"shards[{i}] is not an object")
            entry = ShardEntry(_field(s, "name", str, where, f"shards[{i}]."),
                               _field(s, "start", int, where, f"shards[{i}]."),
                               _field(s, "count", int, where, f"shards[{i}]."),
                               _field(s, "bytes", int, where, f"shards[{i}]."),
                               _field(s, "sha256", str, where, f"shards[{i}]."))
            if not _SHARD_NAME.match(entry.name):
                raise _bad(where, f"shards[{i}].name {entry.name!r} is not shard-IIIII-of-KKKKK")
            if not _HEX64.match(entry.sha256):
                raise _bad(where, f"shards[{i}].sha256 is not 64 lowercase hex digits")
            if entry.count < 0 or entry.bytes < 0:
                raise _bad(where, f"shards[{i}] has a negative count or size")
            expected = shards[-1].start + shards[-1].count if shards else 0
            if entry.start != expected:
                raise _bad(where, f"shards[{i}].start is {entry.start}, expected {expected} (ranges must tile)")
            shards.append(entry)
        total = shards[-1].start + shards[-1].count if shards else 0
        if num < 0 or total != num:
            raise _bad(where, f"num_samples is {num} but the shards hold {total}")
        samples = None
        if version >= 2:
            s = _field(d, "samples", dict, where)
            kinds = (("name", str), ("bytes", int), ("sha256", str), ("count", int))
            samples = SamplesEntry(*(_field(s, name, kind, where, "samples.") for name, kind in kinds))
            if samples.name != SAMPLES_NAME:
                raise _bad(where, f"samples.name {samples.name!r} is not {SAMPLES_NAME!r}")
            if not _HEX64.match(samples.sha256):
                raise _bad(where, "samples.sha256 is not 64 lowercase hex digits")
            if samples.bytes < 0 or samples.count != num:
                raise _bad(where, f"samples has {samples.bytes} bytes and {samples.count} samples; expected a "
                                  f"non-negative size and num_samples ({num})")
        elif "samples" in d:
            raise _bad(where, "field 'samples' is not part of format_version 1")
        return cls(version, tuple(shards), tuple(classes), num, options, counts, samples)

    @functools.cached_property
    def _starts(self) -> list[int]:  # once: locate() runs for every sample a reader reads
        return [s.start for s in self.shards]

    def locate(self, index: int) -> tuple[int, int]:
        """``(shard position, index within that shard)`` of global sample ``index``."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is outside 0..{self.num_samples - 1}")
        i = bisect.bisect_right(self._starts, index) - 1
        while self.shards[i].count == 0:  # empty shards share their start with the next one
            i += 1
        return i, index - self.shards[i].start


def samples_object(labels: list[int], paths: list[str]) -> tuple[bytes, SamplesEntry]:
    """The ``samples.json.gz`` bytes for these labels and relative paths (store order), and its entry.

    The same inputs give the same bytes (sorted keys, fixed separators, gzip without a name or
    a timestamp), so every engine and worker count publishes the same object.
    """
    import gzip
    import hashlib

    if len(labels) != len(paths):
        raise ValueError(f"{len(labels)} labels but {len(paths)} paths")
    text = json.dumps({"labels": [int(x) for x in labels], "paths": list(paths)}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=False)
    data = gzip.compress(text.encode(), compresslevel=6, mtime=0)
    return data, SamplesEntry(SAMPLES_NAME, len(data), hashlib.sha256(data).hexdigest(), len(labels))


#: the most one relative path can take in ``samples.json.gz``: PATH_MAX bytes, each escaped at worst to
#: 6 (``\\u001f``), with its quotes and comma
_PATH_MAX_JSON = 4096 * 6 + 3


def samples_limit(num_samples: int, num_classes: int) -> int:
    """The most bytes ``samples.json.gz`` of ``num_samples`` samples can inflate to: each label (the
    digits of the largest class and a comma) and each path (``_PATH_MAX_JSON``), plus the keys. Past
    it the object is not read further: a small object that inflates to gigabytes is refused."""
    return 64 + num_samples * (len(str(max(0, num_classes - 1))) + 1 + _PATH_MAX_JSON)


def parse_samples(data: bytes | None, manifest: Manifest, *,
                  where: str = SAMPLES_NAME) -> tuple[list[int], list[str]]:
    """``(labels, paths)`` from the ``samples.json.gz`` bytes, checked against ``manifest.samples``.

    ``data`` is None when the object is not there (the caller looked: a file or an object).

    Raises:
        ManifestError: the object is missing, its bytes are not the size or sha256 the manifest
            names, or their content does not fit the manifest (count, labels outside the
            classes, more bytes inflated than ``samples_limit`` allows); names ``where``.
    """
    import hashlib
    import zlib

    entry = manifest.samples
    if entry is None:
        raise ValueError("a format-1 manifest has no samples object")
    if data is None:
        raise ManifestError(f"{where}: missing: the labels object was deleted (the manifest, format 2, names it: "
                            "every sample's label and path).\nHINT: copy it back from where the store came from, "
                            "or convert the source again into a new DST.")
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != entry.bytes or digest != entry.sha256:
        raise ManifestError(f"{where}: {len(data)} bytes of sha256 {digest[:16]}..., the manifest says {entry.bytes} "
                            f"bytes of sha256 {entry.sha256[:16]}...: the labels object or the manifest was "
                            "replaced or damaged; none of it was used.\nHINT: check the store with `fastload "
                            "verify`; convert the source again into a new DST if it persists.")
    limit = samples_limit(manifest.num_samples, len(manifest.classes))
    try:
        inflate = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # gzip; never more than the limit in memory
        text = inflate.decompress(data, limit + 1)
        if len(text) > limit or inflate.unconsumed_tail:
            raise _bad(where, f"the samples object inflates to more than {limit:,} bytes, the most "
                              f"{manifest.num_samples:,} samples' labels and paths can take (a gzip bomb?)")
        if not inflate.eof or inflate.unused_data:
            raise ValueError("truncated, or trailing bytes after the gzip stream")
        d = json.loads(text)
        labels, paths = d["labels"], d["paths"]
    except (OSError, ValueError, EOFError, KeyError, TypeError, zlib.error) as exc:
        raise _bad(where, f"the samples object does not hold labels and paths ({exc})") from None
    k = len(manifest.classes)
    if (not isinstance(labels, list) or not isinstance(paths, list) or len(labels) != manifest.num_samples
            or len(paths) != manifest.num_samples):
        raise _bad(where, f"the samples object does not hold {manifest.num_samples} labels and paths")
    if not all(type(x) is int and 0 <= x < k for x in labels) or not all(isinstance(p, str) for p in paths):
        raise _bad(where, f"the samples object holds a label outside 0..{k - 1} or a path that is not a string")
    return labels, paths


def _bad(where: str, what: str, *, hint: str | None = None) -> ManifestError:
    return ManifestError(f"{where}: the manifest is invalid: {what}.\nHINT: "
                         + (hint or "the store was damaged or written by something else; verify it with "
                                    "`fastload verify`, or convert the source again into a new DST."))


def _field(d: dict, name: str, kind: type, where: str, prefix: str = "") -> Any:
    if name not in d:
        raise _bad(where, f"field '{prefix}{name}' is missing")
    value = d[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _bad(where, f"field '{prefix}{name}' must be {kind.__name__}, got {type(value).__name__}")
    return value
