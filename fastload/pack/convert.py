"""``convert(source, dst, options) -> ConvertReport``: pack a dataset into an LMDB store.

Owns: the conversion run. Worker processes (``pool.imap_isolated``) read, validate and,
when needed, canonicalise or re-encode each file (``pack.work.prepare_item``: typed
``PrepareOptions`` in, ``Prepared | Rejected`` out, around ``image.policy.prepare``); this process
commits them in order through ``store.writer.StoreWriter``, in chunked transactions, each
carrying a chunk record of what it consumed. A rerun finds the committed chunks and
continues after them, so SIGKILL at any moment and a rerun give the same records as one
uninterrupted run. The metadata record is written last.

Must not: decode images itself (workers do), or import torch.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fastload.errors import ConvertError
from fastload.image.policy import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_PIXELS, ENCODING_CHOICES
from fastload.pool import imap_isolated
from fastload.pack.sources import Source, open_source
from fastload.pack.work import PrepareOptions, Prepared, Rejected
from fastload.store import format as fmt
from fastload.store import remote
from fastload.store.writer import StoreWriter

__all__ = ["ConvertOptions", "ConvertReport", "convert", "REPORT_NAME"]

REPORT_NAME = "report.json"
_HANDLER = "fastload.pack.work:prepare_item"  # what workers run per file ("module:function")
_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    """How to convert.

    Args:
        max_side: downscale images whose longer side is larger to this size, re-encoded as
            JPEG (FFCV's ``max_resolution`` semantics). None keeps original sizes.
        quality: JPEG quality for re-encoding (default 90 with ``max_side``); given alone,
            every image is re-encoded at this quality.
        shuffle: write samples in a seeded random order (labels follow).
        seed: the shuffle seed.
        num_shards, shard_index: pack only shard ``shard_index`` of ``num_shards``, into
            ``dst/shard-IIIII-of-KKKKK``.
        strict: stop at the first unreadable file (after committing what came before).
        workers: validation processes; None = the CPUs this process may use.
        chunk_size: samples per write transaction.
        max_pixels: larger images are refused as decompression bombs.
        progress: show a tqdm progress bar.
        initial_map_size: first LMDB map size in bytes (None: from the source size); the
            map doubles whenever it is full.
        max_file_bytes: files larger than this are skipped unread.
        follow_symlinks: read symbolic links that point outside the source (default: such
            links are skipped with a reason; links inside the source are always read).
        num_classes: for file lists with integer labels, the number of classes (labels must
            lie in ``0..num_classes-1``).
        encoding: ``"jpeg"`` (encoded images; originals where allowed), ``"raw"`` (raw RGB
            pixels: no decode when training, 10-15x the bytes of a JPEG) or ``"auto"`` (raw up to
            256x256 pixels after ``max_side``, encoded above).
        lossless: keep non-JPEG sources pixel-exact (PNG) instead of re-encoding them as
            JPEG q95 4:4:4, the faster-loading default (``image.policy`` says why).
    """

    max_side: int | None = None
    quality: int | None = None
    encoding: str = "jpeg"
    shuffle: bool = False
    seed: int = 0
    num_shards: int = 1
    shard_index: int = 0
    strict: bool = False
    workers: int | None = None
    chunk_size: int = 256
    max_pixels: int = DEFAULT_MAX_PIXELS
    progress: bool = True
    initial_map_size: int | None = None
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    follow_symlinks: bool = False
    num_classes: int | None = None
    lossless: bool = False

    def __post_init__(self) -> None:
        if self.max_side is not None and self.max_side < 8:
            raise ValueError(f"max_side must be >= 8, got {self.max_side}")
        if self.quality is not None and not 1 <= self.quality <= 100:
            raise ValueError(f"quality must be in 1..100, got {self.quality}")
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard_index must be in 0..{self.num_shards - 1}, got {self.shard_index}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1, got {self.max_pixels}")
        if self.encoding not in ENCODING_CHOICES:
            raise ValueError(f"Unknown value {self.encoding!r} for argument encoding. Valid values are "
                             f"{', '.join(ENCODING_CHOICES)}.")
        if self.max_file_bytes < 1:
            raise ValueError(f"max_file_bytes must be >= 1, got {self.max_file_bytes}")
        if self.num_classes is not None and self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        if self.lossless and (self.max_side is not None or self.quality is not None):
            raise ValueError("lossless cannot be combined with max_side or quality, which re-encode as lossy JPEG; "
                             "for exact downscaled pixels use max_side with encoding='raw'")

    def record_options(self) -> dict[str, Any]:
        """The options that decide which records a store holds (saved in its metadata)."""
        return {"max_side": self.max_side, "quality": self.quality, "encoding": self.encoding, "shuffle": self.shuffle,
                "seed": self.seed if self.shuffle else None, "num_shards": self.num_shards,
                "shard_index": self.shard_index, "max_pixels": self.max_pixels,
                "max_file_bytes": self.max_file_bytes, "follow_symlinks": self.follow_symlinks,
                "num_classes": self.num_classes, "lossless": self.lossless}


@dataclass
class ConvertReport:
    """What a conversion did. ``to_json()`` is what ``report.json`` holds."""

    dst: Path
    source: str
    total: int = 0
    stored: int = 0
    skipped: list[dict[str, str]] = field(default_factory=list)
    canonicalised: dict[str, int] = field(default_factory=dict)
    reencoded: int = 0
    reencoded_reasons: dict[str, int] = field(default_factory=dict)
    lossy: dict[str, Any] = field(default_factory=dict)  # count, psnr_min, psnr_median of lossy writes
    bytes_stored: int = 0
    resumed_from: int = 0
    already_complete: bool = False
    warnings: list[str] = field(default_factory=list)
    #: files stored after a repair Pillow needs (docs/jpeg-damage.md): ``{"relpath", "what"}``, of every
    #: run that wrote the store (kept in its chunk records across a resume, then in its header)
    salvaged: list[dict[str, str]] = field(default_factory=list)
    #: decoder (Pillow) warnings per file, stored or skipped, of every run: ``{"relpath", "warnings": [...]}``
    decoder_warnings: list[dict[str, Any]] = field(default_factory=list)
    #: classes with no stored sample (no files, or every file skipped); they keep their label
    empty_classes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def images_per_s(self) -> float:
        done = self.total - self.resumed_from
        return done / self.seconds if self.seconds > 0 else 0.0

    def summary_line(self) -> str:
        if self.already_complete:
            return f"{self.dst}: already complete ({self.stored} samples); nothing to do."
        parts = [f"{self.dst}: stored {self.stored} of {self.total} images",
                 f"skipped {len(self.skipped)}",
                 f"canonicalised {sum(self.canonicalised.values())}"]
        if self.reencoded:
            parts.append(f"re-encoded {self.reencoded}")
        if self.salvaged:
            parts.append(f"salvaged {len(self.salvaged)} (named in report.json)")
        if self.decoder_warnings:
            parts.append(f"decoder warnings on {len(self.decoder_warnings)} files (in report.json)")
        if self.empty_classes:
            parts.append(f"{len(self.empty_classes)} EMPTY classes")
        if self.resumed_from:
            parts.append(f"resumed after {self.resumed_from}")
        parts.append(f"{self.bytes_stored / 1e6:.1f} MB in {self.seconds:.1f}s ({self.images_per_s:.0f} img/s)")
        return ", ".join(parts)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["dst"] = str(self.dst)
        d["images_per_s"] = self.images_per_s
        return d


def _store_dir(dst: Path, options: ConvertOptions) -> Path:
    if options.num_shards > 1:
        return dst / fmt.shard_dirname(options.shard_index, options.num_shards)
    return dst


def _source_order(src: Source, options: ConvertOptions) -> list[int]:
    order = np.arange(len(src))
    if options.shuffle:
        order = np.random.default_rng(options.seed).permutation(len(src))
    return order[options.shard_index::options.num_shards].tolist()


#: Options that stores written before they existed were converted with (fastload 0.1 kept PNGs lossless).
_OPTIONS_BEFORE = {"lossless": True}


def _differences(have: dict, want: dict, *, contents: bool) -> str:
    """What differs between a stored build record and this run's; "" when nothing does."""
    lines = []
    h, w = have["source"], want["source"]
    if (h["kind"], h["path"], h["classes"]) != (w["kind"], w["path"], w["classes"]):
        lines.append(f"  source: {h['kind']} {h['path']} ({len(h['classes'])} classes) "
                     f"vs now {w['kind']} {w['path']} ({len(w['classes'])} classes)")
    elif contents and h.get("fingerprint") != w.get("fingerprint"):
        lines.append(f"  source: files in {w['path']} were added, removed or changed since it was packed")
    old = {**_OPTIONS_BEFORE, **have["options"]}
    for k in sorted(set(old) | set(want["options"])):
        if old.get(k) != want["options"].get(k):
            lines.append(f"  option {k}: {old.get(k)!r} vs now {want['options'].get(k)!r}")
    return "\n".join(lines)


def _check_prefix(path: Path, src: Source, order: list[int], chunks: list[fmt.ChunkRecord]) -> None:
    """Refuse to resume when files already packed changed: the store would mix two sources."""
    start = 0
    for c in chunks:
        part = order[start:start + c.consumed]
        if len(part) != c.consumed or src.fingerprint(part) != c.fp:
            first = src.items[part[0]][0] if part else "(past the end of the source)"
            raise ConvertError(
                f"{path} holds an unfinished conversion, but files it already packed (from {first} on) "
                "were changed, removed or reordered since.\nHINT: restore them, or delete "
                f"{path} and convert again."
            )
        start += c.consumed


def _source_bytes(src: Source, order: list[int]) -> int:
    """Total size of the files to pack (one stat each; missing files count 0)."""
    total = 0
    for i in order:
        try:
            total += os.stat(src.abspath(src.items[i][0])).st_size
        except OSError:
            pass
    return total


def _write_report(path: Path, report: ConvertReport) -> None:
    tmp = path / (REPORT_NAME + ".tmp")
    tmp.write_text(json.dumps(report.to_json(), indent=1))
    os.replace(tmp, path / REPORT_NAME)


def convert(source: str | os.PathLike[str], dst: str | os.PathLike[str],
            options: ConvertOptions = ConvertOptions()) -> ConvertReport:
    """Pack ``source`` (ImageFolder tree or file list) into the LMDB store ``dst``.

    Resumes an interrupted conversion of the same source with the same options; a rerun
    on a complete store does nothing.

    Returns:
        A ``ConvertReport`` (also written to ``<store>/report.json``).

    Raises:
        SourceError: the source is unusable.
        ConvertError: ``dst`` holds a different conversion, cannot be written (the message
            says whether the disk is full or the folder not writable), or, with
            ``strict``, a file was unreadable.
    """
    t0 = time.perf_counter()
    for what, p in (("source", source), ("dst", dst)):  # an unsupported URL raises here, naming the schemes
        if remote.is_remote(str(p)):
            raise ConvertError(f"{p}: convert() writes one local store; a {what} in object storage is converted "
                               "shard by shard.\nHINT: use pack.engines.convert_sharded (the CLI does so for an "
                               "s3:// gs:// az:// SRC or DST).")
    path = _store_dir(Path(dst), options)
    # a destination inside the source tree must not be scanned as a class (and rescanned on resume)
    src = open_source(source, exclude=(Path(dst),), num_classes=options.num_classes)
    order = _source_order(src, options)
    build = {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION,
             "source": {"kind": src.kind, "path": str(src.path), "classes": src.classes},
             "options": options.record_options()}
    report = ConvertReport(dst=path, source=str(src.path), total=len(order), warnings=list(src.warnings))
    src_bytes = _source_bytes(src, order)
    map_size = options.initial_map_size or max(64 << 20, int(src_bytes * 1.25) + (64 << 20))
    with StoreWriter(path, map_size=map_size) as writer:
        state = writer.resume_state()
        if state.meta is not None:
            final = dict(build, source=dict(build["source"], fingerprint=src.fingerprint()))
            diff = _differences(state.meta, final, contents=True)
            if diff:
                raise ConvertError(f"{path} is a complete store of a different conversion:\n{diff}\n"
                                   "HINT: choose another DST, or delete it to convert again.")
            report.already_complete = True
            _fill(report, state.meta)
            return report
        chunks = state.chunks
        if state.build is not None:
            diff = _differences(state.build, build, contents=False)
            if diff:
                raise ConvertError(
                    f"{path} holds an unfinished conversion with other inputs:\n{diff}\n"
                    "HINT: rerun with the original source and options to finish it, or choose another DST."
                )
            _check_prefix(path, src, order, chunks)
        else:
            writer.start(build)
        _run(writer, src, order, options, chunks, report)
        _empty_classes(report, src, chunks, sharded=options.num_shards > 1)
        header = writer.finalize(build, chunks, classes=src.classes,
                                 source=dict(build["source"], count=len(src), fingerprint=src.fingerprint()))
    _fill(report, header)
    report.seconds = time.perf_counter() - t0
    _write_report(path, report)
    return report


#: files named one by one in ``report.warnings`` (the CLI prints those); the rest are in report.json
_NAMED = 20


def _empty_classes(report: ConvertReport, src: Source, chunks: list[fmt.ChunkRecord], *, sharded: bool) -> None:
    """Classes left without a sample: warned about loudly and recorded (ImageFolder refuses them).
    One shard of several lacking a class is normal: there only classes without any file count."""
    listed = {label for _, label in src.items}
    have = listed if sharded else {label for c in chunks for label in c.labels}
    empty = [(i, name) for i, name in enumerate(src.classes) if i not in have]
    report.empty_classes = [name for _, name in empty]
    if not empty:
        return
    named = ", ".join(f"{name!r} (label {i}: " + ("no image files)" if i not in listed else "every file skipped)")
                      for i, name in empty[:_NAMED])
    more = f" and {len(empty) - _NAMED} more" if len(empty) > _NAMED else ""
    report.warnings.append(
        f"{len(empty)} of {len(src.classes)} classes are EMPTY in the store: {named}{more}. They keep their "
        "labels, with 0 samples; torchvision's ImageFolder refuses an empty class (allow_empty=False).\nHINT: "
        "remove those classes or fix their files, or keep them on purpose (labels then match "
        "ImageFolder(allow_empty=True)).")


def _note(chunk: fmt.ChunkRecord, rel: str, value: Prepared | Rejected) -> None:
    """Record what a worker said about one file besides the verdict, in the chunk that commits it:
    a repair and the decoders' warnings (a resumed run reports those of the killed run too)."""
    chunk.note(path=rel, salvaged=getattr(value, "salvaged", None), warnings=value.warnings)


def _name_salvaged(report: ConvertReport, where: str) -> None:
    """Name the first salvaged files in the warnings (the CLI prints those), the rest by count."""
    report.warnings += [f"{s['relpath']}: salvaged: {s['what']}" for s in report.salvaged[:_NAMED]]
    if len(report.salvaged) > _NAMED:
        report.warnings.append(f"... and {len(report.salvaged) - _NAMED} more salvaged files, named in {where}")


def _fill(report: ConvertReport, header: dict[str, Any]) -> None:
    """The report's counts from a finished store's header (fastload 0.1 headers lack the last two)."""
    report.stored = header["count"]
    report.skipped = header["skipped"]
    report.canonicalised = header["canonicalised"]
    report.reencoded = header["stored_as"]["reencoded"]
    report.reencoded_reasons = header.get("reencoded", {})
    report.lossy = header.get("lossy", {})
    report.bytes_stored = header["bytes"]
    report.salvaged = list(header.get("salvaged", []))
    report.decoder_warnings = list(header.get("decoder_warnings", []))


def validator_options(options: ConvertOptions, src: Source) -> PrepareOptions:
    """What every worker's ``prepare_item`` gets besides the path (``bench convert`` times the same call)."""
    return PrepareOptions.from_convert(options, src)


def _run(writer: StoreWriter, src: Source, order: list[int], options: ConvertOptions,
         chunks: list[fmt.ChunkRecord], report: ConvertReport) -> None:
    """Validate and write every not-yet-committed item; appends to ``chunks``."""
    from tqdm import tqdm

    from fastload.system import available_cpus

    path = writer.path
    consumed = sum(c.consumed for c in chunks)
    stored = sum(c.stored for c in chunks)
    report.resumed_from = consumed
    todo = order[consumed:]
    payloads = [src.abspath(src.items[i][0]) for i in todo]
    init = validator_options(options, src)
    workers = options.workers or available_cpus()
    bar = tqdm(total=len(order), initial=consumed, unit="img", desc=f"convert {path.name}",
               disable=not options.progress, dynamic_ncols=True)
    chunk = fmt.ChunkRecord(n=len(chunks))
    puts: list[tuple[bytes, bytes]] = []

    def flush() -> None:
        nonlocal chunk, puts, stored
        if chunk.consumed == 0:
            return
        first = sum(c.consumed for c in chunks)
        chunk.fp = src.fingerprint(order[first:first + chunk.consumed])
        writer.commit_chunk(chunk, puts, committed=stored)
        stored += chunk.stored
        chunks.append(chunk)
        chunk, puts = fmt.ChunkRecord(n=chunk.n + 1), []

    try:
        for j, ok, value in imap_isolated(_HANDLER, init, payloads, workers):
            rel, label = src.items[todo[j]]
            chunk.consumed += 1
            if ok and isinstance(value, Prepared | Rejected):
                _note(chunk, rel, value)
            if ok and isinstance(value, Prepared):
                data = value.data
                puts.append((fmt.sample_key(stored + chunk.stored), data))
                chunk.add(label=label, crc32=zlib.crc32(data), encoding=value.encoding, stored_as=value.stored_as,
                          reason=value.reason, path=rel, nbytes=len(data), psnr=value.psnr)
            elif not ok and getattr(value, "io", False):
                # the file could not be read now (disk, object store): not a bad image. Keep what is
                # committed and stop, so a rerun reads it again instead of it being skipped for good.
                chunk.consumed -= 1
                flush()
                from fastload.pack.shard import read_failed

                raise read_failed(src.abspath(rel), value)
            else:
                reason = value.reason if isinstance(value, Rejected) else value
                chunk.skipped.append({"relpath": rel, "reason": reason})
                bar.set_postfix(skipped=sum(len(c.skipped) for c in chunks) + len(chunk.skipped))
                if options.strict:
                    chunk.consumed -= 1  # the bad file is not consumed: fix it and rerun
                    chunk.skipped.pop()
                    if chunk.decoder_warnings and chunk.decoder_warnings[-1]["relpath"] == rel:
                        chunk.decoder_warnings.pop()  # said again when the rerun reads the file
                    flush()
                    raise ConvertError(
                        f"{src.abspath(rel)}: {reason}\n(--strict stops at the first bad file; the "
                        f"{stored} samples before it are committed.)\nHINT: fix or remove the file and "
                        "rerun the same command, or drop --strict to skip bad files and report them."
                    )
            bar.update()
            if chunk.stored >= options.chunk_size or chunk.bytes >= _CHUNK_BYTES:
                flush()
        flush()
    finally:
        bar.close()
    report.salvaged = [x for c in chunks for x in c.salvaged]  # this run's and any killed run's before it
    report.decoder_warnings = [x for c in chunks for x in c.decoder_warnings]
    _name_salvaged(report, str(path / REPORT_NAME))
