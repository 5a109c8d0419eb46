"""What a conversion worker is handed and hands back, as typed values (#23).

Owns: ``PrepareOptions`` (options in) and ``Prepared | Rejected`` (out), and
``prepare_item(location, options)``, the per-file entry point of sharded conversion: read the
bytes (a local path, or an object URL through ``store.remote``), then ``image.policy`` decides
what to store. Picklable all the way, for worker processes and Ray tasks.

Must not: write stores or decide placement (``engines.py`` does).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass

from fastload.image.formats import BadImage
from fastload.image.policy import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_PIXELS, prepare, prepare_file
from fastload.store import remote

__all__ = ["PrepareOptions", "Prepared", "Rejected", "prepare_item"]


@dataclass(frozen=True, kw_only=True)
class PrepareOptions:
    """How each file is validated and what is stored (``image.policy.prepare``'s keywords, and the
    reading limits: ``max_file_bytes``; ``inside``: a local link resolving outside it is not read)."""

    max_pixels: int = DEFAULT_MAX_PIXELS
    max_side: int | None = None
    quality: int | None = None
    encoding: str = "jpeg"
    lossless: bool = False
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    inside: str | None = None

    @classmethod
    def from_convert(cls, options, src) -> PrepareOptions:
        local = not remote.is_remote(str(src.root))
        return cls(max_pixels=options.max_pixels, max_side=options.max_side, quality=options.quality,
                   encoding=options.encoding, lossless=options.lossless, max_file_bytes=options.max_file_bytes,
                   inside=os.path.realpath(src.root) if local and not options.follow_symlinks else None)

    def policy_keywords(self) -> dict:
        return {"max_pixels": self.max_pixels, "max_side": self.max_side, "quality": self.quality,
                "encoding": self.encoding, "lossless": self.lossless}


@dataclass(frozen=True)
class Prepared:
    """One file accepted: the bytes to store, how, why, the PSNR of a lossy write, the source's size."""

    data: bytes
    encoding: str
    stored_as: str
    reason: str | None
    psnr: float | None
    source_bytes: int
    salvaged: str | None = None  # what was repaired so that Pillow reads it (docs/jpeg-damage.md)
    warnings: tuple[str, ...] = ()  # what the decoders warned about on this file


@dataclass(frozen=True)
class Rejected:
    """One file skipped, and why (the report names it)."""

    reason: str
    warnings: tuple[str, ...] = ()  # what the decoders warned about on this file


def prepare_item(location: str, options: PrepareOptions) -> Prepared | Rejected:
    """Read and prepare one file: a local path, or ``s3://...`` (also ``tar://`` / ``parquet://`` members).
    Decoder (Pillow) warnings are caught and handed back with the value, for the report, not printed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _prepare_item(location, options)
    said = tuple(dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught))
    return dataclasses.replace(out, warnings=out.warnings + said) if said else out


def _prepare_item(location: str, options: PrepareOptions) -> Prepared | Rejected:
    if location.startswith(("member:", "row:")):  # inside a tar shard or a Parquet file (pack/containers.py)
        from fastload.pack.containers import read_member

        try:
            data = read_member(location)
        except Exception as exc:  # noqa: BLE001 - reported against this sample; the shard goes on
            if isinstance(exc, OSError) or getattr(exc, "io_failure", False):
                raise  # the container could not be read now (disk, object store): fail the shard, not skip
            return Rejected(f"cannot read it from its container: {type(exc).__name__}: {exc}")
        if len(data) > options.max_file_bytes:
            return Rejected(f"larger than the {options.max_file_bytes:,}-byte limit ({len(data):,} bytes)")
        try:
            p = prepare(data, **options.policy_keywords())
        except BadImage as exc:
            return Rejected(str(exc))
        except MemoryError:
            return Rejected("out of memory while decoding")
        return Prepared(p.data, p.encoding, p.stored_as, p.reason, p.psnr, len(data), p.salvaged)
    if remote.is_remote(location):
        try:
            size = remote.head(location)
            if size is None:
                return Rejected("object not found")
            if size > options.max_file_bytes:
                return Rejected(f"larger than the {options.max_file_bytes:,}-byte limit ({size:,} bytes)")
            data = remote.get_bytes(location)
            p = prepare(data, **options.policy_keywords())
        except BadImage as exc:
            return Rejected(str(exc))
        except MemoryError:
            return Rejected("out of memory while decoding")
        return Prepared(p.data, p.encoding, p.stored_as, p.reason, p.psnr, len(data), p.salvaged)
    value = prepare_file(location, {**options.policy_keywords(), "max_file_bytes": options.max_file_bytes,
                                    "inside": options.inside})
    notes = value[-1]  # the decoders' warnings and any repair (``prepare_file``)
    if value[0] != "ok":
        return Rejected(value[1], tuple(notes["warnings"]))
    _, data, encoding, stored_as, reason, psnr, _ = value
    try:
        nbytes = os.path.getsize(location)
    except OSError:
        nbytes = 0
    return Prepared(data, encoding, stored_as, reason, psnr, nbytes, notes["salvaged"], tuple(notes["warnings"]))
