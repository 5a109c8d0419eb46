"""Checking a store: ``inspect_store`` (what it holds) and ``verify_store`` (re-read everything).

Owns: the tools a user runs on a finished store. ``verify_store`` re-reads every record in
crash-isolated worker processes (``fastload.pool``: a decoder that segfaults on a record
is reported against that record, the rest goes on), checks each record's crc32, and
decodes it with every decoder asked for, comparing the pixels with the reference decode
(Pillow) of the same bytes. Opening the store already checks the metadata (checksums,
labels inside the class range, one path per sample: ``format.parse_meta``).

Decoders (``--decoders``): ``fastload`` (the fast path the loaders use; the default),
``pil``, ``torchvision`` (``torchvision.io.decode_image``; not raw records), ``simplejpeg``
(JPEG records only), ``dali`` (DALI's CPU decoder). A decoder disagrees when the mean absolute
difference from Pillow's pixels is above ``DISAGREE_BOUND`` (0 for libjpeg-turbo based
decoders, which are bit-exact; 0.5 grey levels for DALI).

Must not: be imported by the hot read path (``reader.py``), or write.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fastload.errors import IncompleteStoreError
from fastload.store import format as fmt
from fastload.store.manifest import MANIFEST_NAME
from fastload.store.reader import StoreReader, load_store_metas

__all__ = ["inspect_store", "verify_store", "VerifyReport", "report_json", "DECODERS", "DISAGREE_BOUND",
           "verify_remote_shards", "check_local_manifest"]

DECODERS = ("fastload", "pil", "torchvision", "simplejpeg", "dali")
DISAGREE_BOUND = {"fastload": 0.0, "pil": 0.0, "torchvision": 0.0, "simplejpeg": 0.0, "dali": 0.5}
_RANGE = 128


def inspect_store(path: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """What a store holds: counts, classes, bytes, encodings, options, completeness.

    ``path`` may be the URL of a sharded store in object storage: its shards are read through
    the node cache (``cache_dir``, default ``remote_store.default_cache_dir()``), downloaded if
    not there, and summed exactly as a local folder of shards is.
    """
    from fastload.store.remote import is_remote

    if is_remote(str(path)):
        try:
            metas = _remote_metas(str(path), cache_dir)
        except IncompleteStoreError as exc:
            return {"path": str(path), "complete": False, "problem": str(exc)}
        path = str(path)
    else:
        path = Path(path)
        try:
            metas = load_store_metas(path)
        except IncompleteStoreError as exc:
            return {"path": str(path), "complete": False, "problem": str(exc)}
    labels = np.concatenate([m.labels for m in metas])
    classes = metas[0].classes
    counts = np.bincount(labels, minlength=len(classes)) if len(labels) else np.zeros(len(classes), int)
    total: dict[str, Any] = {"encodings": {}, "stored_as": {}, "canonicalised": {}, "reencoded": {}}
    for m in metas:
        for key in total:
            for k, v in m.header.get(key, {}).items():  # "reencoded" is absent from stores of fastload 0.1
                total[key][k] = total[key].get(k, 0) + v
    count = int(len(labels))
    nbytes = int(sum(m.header["bytes"] for m in metas))
    return {
        "path": str(path),
        "complete": True,
        "format_version": metas[0].header["version"],
        "count": count,
        "shards": len(metas) if len(metas) > 1 else None,
        "classes": {c: int(n) for c, n in zip(classes, counts)},
        "bytes": nbytes,
        "bytes_per_image": nbytes / count if count else 0.0,
        "skipped": sum(len(m.header["skipped"]) for m in metas),
        "source": metas[0].header["source"],
        "options": metas[0].header["options"] if len(metas) == 1 else
        [m.header["options"] for m in metas],
        **total,
        # the fidelity of the records fastload encoded lossily, over every shard (median: of all their writes)
        "lossy": {k: v for k, v in fmt.lossy_summary(headers=[m.header for m in metas]).items() if k != "psnr_hist"},
    }


def _remote_metas(url: str, cache_dir) -> list:
    from fastload.errors import RemoteStoreError
    from fastload.store.remote_store import RemoteStoreReader

    try:
        reader = RemoteStoreReader(url, cache_dir=cache_dir)
    except RemoteStoreError as exc:
        if exc.reason == "missing":  # no manifest.json: the conversion has not finished
            raise IncompleteStoreError(f"{url}: no manifest.json: the store is incomplete.\n"
                                       "HINT: rerun the `fastload convert` that writes it.") from None
        raise
    try:
        return [reader._shard(i)[1] for i in range(len(reader.specs))]
    finally:
        reader.close()


@dataclass
class VerifyReport:
    """The outcome of ``verify_store``: ``failures`` holds ``(index, relpath, reason)``; ``shards``
    holds ``(shard file, problem)`` for a folder of shards whose files differ from its manifest."""

    path: str
    count: int
    decoders: tuple[str, ...] = ("fastload",)
    failures: list[tuple[int, str, str]] = field(default_factory=list)
    shards: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures and not self.shards

    def by_decoder(self) -> dict[str, list[int]]:
        """Failing indices per decoder (``"checksum"`` for records that fail their checksum)."""
        out: dict[str, list[int]] = {d: [] for d in ("checksum", *self.decoders)}
        for i, _, why in self.failures:
            key = why.split(":", 1)[0]
            out.setdefault(key, []).append(i)
        return out


def _reference(data: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


class _Decoders:
    """Decoders by name, built once per worker process."""

    def __init__(self) -> None:
        self._dali = None

    def decode(self, name: str, data: bytes) -> np.ndarray | None:
        if name == "fastload":
            from fastload.image.fast import decode_rgb_fast

            return decode_rgb_fast(data)
        if name == "pil":
            from fastload.image.policy import decode_rgb

            return decode_rgb(data)
        if name == "torchvision":
            if data[:2] == b"P6":  # raw records: torchvision.io reads no PPM, and there is nothing to decode
                return None
            import torch
            from torchvision.io import ImageReadMode, decode_image

            t = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
            return t.permute(1, 2, 0).numpy()
        if name == "simplejpeg":
            if data[:3] != b"\xff\xd8\xff":
                return None
            import simplejpeg

            return simplejpeg.decode_jpeg(data, colorspace="RGB")
        if name == "dali":
            return self._dali_decode(data)
        raise ValueError(name)

    def _dali_decode(self, data: bytes) -> np.ndarray:
        if self._dali is None:
            from nvidia.dali import fn, pipeline_def, types

            feed: list[np.ndarray] = []

            # not pipelined, no prefetch: the source is called exactly once per run, for this record
            @pipeline_def(batch_size=1, num_threads=1, device_id=None, exec_pipelined=False, exec_async=False,
                          prefetch_queue_depth=1)
            def pipe():
                raw = fn.external_source(source=lambda: [feed.pop()], batch=True, dtype=types.UINT8, ndim=1)
                return fn.decoders.image(raw, device="cpu", output_type=types.RGB)

            p = pipe()
            p.build()
            self._dali = (p, feed)
        p, feed = self._dali
        feed.append(np.frombuffer(data, dtype=np.uint8))
        return np.asarray(p.run()[0].as_tensor())[0]


_DECODERS_IN_PROCESS: _Decoders | None = None


def verify_range(payload: tuple[str, int, int, tuple[str, ...]], _init: Any = None) -> list[tuple[int, str, str]]:
    """Worker task: check ``[start, stop)`` of a store; ``(index, relpath, "decoder: reason")`` per problem."""
    global _DECODERS_IN_PROCESS
    path, start, stop, decoders = payload
    if _DECODERS_IN_PROCESS is None:
        _DECODERS_IN_PROCESS = _Decoders()
    dec = _DECODERS_IN_PROCESS
    reader = StoreReader(path, verify=False)
    bad = []
    try:
        for i in range(start, stop):
            rel = reader.paths[i]
            try:
                data = reader.get(i, verify=False)
                problem = reader.checksum_problem(i, data)
            except Exception as exc:
                problem = f"unreadable ({exc})"
            if problem is not None:
                bad.append((i, rel, f"checksum: {problem}"))
                continue
            try:
                ref = _reference(data)
            except Exception as exc:
                ref = None
                ref_error = exc
            for name in decoders:
                try:
                    got = dec.decode(name, data)
                except Exception as exc:
                    bad.append((i, rel, f"{name}: decode failed ({type(exc).__name__}: {exc})"))
                    continue
                if got is None:
                    continue
                if ref is None:
                    bad.append((i, rel, f"{name}: decodes, but Pillow fails on it ({ref_error})"))
                    continue
                if got.shape != ref.shape:
                    bad.append((i, rel, f"{name}: decodes to {got.shape}, Pillow to {ref.shape}"))
                    continue
                diff = float(np.abs(got.astype(np.int16) - ref.astype(np.int16)).mean())
                if diff > DISAGREE_BOUND[name]:
                    bad.append((i, rel, f"{name}: pixels disagree with Pillow's (mean |difference| {diff:.3f} > "
                                        f"{DISAGREE_BOUND[name]})"))
    finally:
        reader.close()
    return bad


def verify_store(path: str | os.PathLike[str], *, decode: bool = True, decoders: tuple[str, ...] = ("fastload",),
                 workers: int | None = None, progress: bool = False) -> VerifyReport:
    """Re-read every record, check its checksum and decode it with each of ``decoders``.

    Each range of records runs in a crash-isolated worker process; a range whose worker
    crashed is rerun one record per task, so the crash is reported against its record.

    A folder of shards with a ``manifest.json`` is first checked against it (``check_local_manifest``:
    the shards it names, each shard file's size and sha256, and ``samples.json.gz``, as
    ``verify_remote_shards`` checks a bucket); a shard file that differs is in ``report.shards``.

    Raises:
        StoreError: the path is not a complete, intact store (metadata checked on open).
        ManifestError: its manifest or ``samples.json.gz`` is missing, damaged or replaced.
        ValueError: an unknown decoder name.
    """
    from tqdm import tqdm

    from fastload.pool import imap_isolated
    from fastload.system import available_cpus

    unknown = [d for d in decoders if d not in DECODERS]
    if unknown:
        raise ValueError(f"Unknown decoder {unknown[0]!r}. Valid decoders are {', '.join(DECODERS)}.")
    if "dali" in decoders:
        from fastload.system import DALI_INSTALL_HINT, dali_available
        from fastload.errors import MissingDependencyError

        if not dali_available():
            raise MissingDependencyError(f"--decoders dali needs DALI.\nHINT: {DALI_INSTALL_HINT}")
    reader = StoreReader(path)
    shard_problems: list[tuple[str, str]] = []
    if (Path(path) / MANIFEST_NAME).is_file():  # a folder of shards that fastload convert --num-shards wrote
        shard_problems = check_local_manifest(Path(path), reader, progress=progress)
    n = len(reader)
    used = tuple(decoders) if decode else ()
    report = VerifyReport(str(path), n, used, shards=shard_problems)
    handler = f"{__name__}:verify_range"
    jobs = [(str(path), s, min(n, s + _RANGE), used) for s in range(0, n, _RANGE)]
    workers = max(1, min(workers or available_cpus(), len(jobs) or 1))
    crashed: list[tuple] = []
    with tqdm(total=n, unit="img", desc="verify", disable=not progress) as bar:
        for j, ok, value in imap_isolated(handler, None, jobs, workers):
            if ok:
                report.failures.extend(value)
            else:
                crashed.append(jobs[j])
            bar.update(jobs[j][2] - jobs[j][1])
        for job in crashed:  # pinpoint the record that crashed its worker
            singles = [(job[0], i, i + 1, job[3]) for i in range(job[1], job[2])]
            for k, ok, value in imap_isolated(handler, None, singles, workers):
                if ok:
                    report.failures.extend(value)
                else:
                    i = singles[k][1]
                    report.failures.append((i, reader.paths[i], f"crash: a decoder crashed its process ({value})"))
    report.failures.sort()
    return report


def report_json(report: VerifyReport) -> str:
    return json.dumps({"path": report.path, "count": report.count, "ok": report.ok, "decoders": list(report.decoders),
                       "failing_by_decoder": report.by_decoder(),
                       "failures": [{"index": i, "relpath": r, "reason": why} for i, r, why in report.failures],
                       "shard_problems": [{"file": f, "problem": why} for f, why in report.shards]},
                      indent=1)


def verify_remote_shards(url: str, *, progress: bool = True) -> tuple[int, list[tuple[str, str]]]:
    """Check every shard object of a sharded store in object storage against its manifest.

    Each ``shard-*/data.mdb`` object must exist, have the manifest's size and sha256, and so must
    ``samples.json.gz`` (format 2: every label and path; its content must fit the manifest). Each
    shard's own records must then agree with what is handed out before any shard is read: its class
    names with the manifest's, its labels and paths with ``samples.json.gz``'s.
    Records and decoders are checked by ``verify_store`` once the store is read through the node cache.

    Returns:
        ``(shards checked, [(shard object URL, what is wrong)])``.

    Raises:
        IncompleteStoreError: no ``manifest.json`` (the conversion did not finish).
        ManifestError: the manifest is invalid.
        RemoteStoreError: the bucket cannot be read (names the URL).
    """
    import shutil
    import tempfile

    from tqdm import tqdm

    from fastload.store import remote
    from fastload.errors import ManifestError
    from fastload.store.cache import sha256_file
    from fastload.store.manifest import SAMPLES_NAME, SHARD_FILE, Manifest, parse_samples

    base = remote.RemoteLocation.parse(url)
    murl = base.child(MANIFEST_NAME)
    if remote.head(murl) is None:  # a missing bucket raises here (remote.stat lists when HEAD says 404)
        if not remote.list_prefix(base):
            raise IncompleteStoreError(f"{base}: nothing at this URL (no objects under the prefix).\nHINT: check "
                                       "the bucket and prefix (a typo?); a store converted there has a manifest.json.")
        raise IncompleteStoreError(f"{murl}: no manifest: the conversion into {base} has not finished.\nHINT: rerun "
                                   "the same `fastload convert` command: it redoes only the missing shards.")
    manifest = Manifest.from_json(remote.get_bytes(murl), where=str(murl))
    problems: list[tuple[str, str]] = []
    samples = None  # (labels, paths) of samples.json.gz, once it is the object the manifest names
    if manifest.samples is not None:  # checked first: the shards' records are compared with it below
        obj = base.child(SAMPLES_NAME)
        try:
            samples = parse_samples(None if remote.head(obj) is None else remote.get_bytes(obj), manifest,
                                    where=str(obj))
        except ManifestError as exc:
            problems.append((str(obj), str(exc).split("\nHINT")[0].removeprefix(f"{obj}: ")))
    with tempfile.TemporaryDirectory(prefix="fastload-verify-") as tmp:
        for entry in tqdm(manifest.shards, unit="shard", desc=f"verify {base}", disable=not progress):
            obj = base.child(f"{entry.name}/{SHARD_FILE}")
            size = remote.head(obj)
            if size is None:
                problems.append((str(obj), "missing: the shard object was deleted"))
                continue
            if size != entry.bytes:
                problems.append((str(obj), f"{size} bytes, the manifest says {entry.bytes}"))
                continue
            folder = Path(tmp) / entry.name
            folder.mkdir()
            local = folder / SHARD_FILE
            remote.download_file(obj, local)
            digest = sha256_file(local)
            if digest != entry.sha256:
                problems.append((str(obj), f"sha256 {digest[:16]}... differs from the manifest's "
                                           f"{entry.sha256[:16]}... (the object is corrupted)"))
            else:
                problems += _shard_records_against(str(obj), folder, entry, manifest, samples)
            shutil.rmtree(folder)
    return len(manifest.shards), problems


def _shard_records_against(url: str, folder: Path, entry, manifest, samples) -> list[tuple[str, str]]:
    """``(what, problem)`` where a shard's own records (its class names, labels and paths) differ from the
    manifest's class names and ``samples.json.gz``: both are handed out before any shard is read (``ds.classes``,
    ``targets``), so a manifest edited to match another labels object is found here, not in training."""
    from fastload.store.manifest import SAMPLES_NAME
    from fastload.store.reader import briefly, read_meta, release

    with briefly(folder) as env:
        meta = read_meta(env, folder)
    release(folder)
    out = []
    if list(meta.classes) != list(manifest.classes):
        k = next((j for j, (a, b) in enumerate(zip(meta.classes, manifest.classes)) if a != b),
                 min(len(meta.classes), len(manifest.classes)))
        say = (lambda c: repr(c[k]) if k < len(c) else "nothing")  # noqa: E731
        out.append((url, f"class {k} is {say(meta.classes)} in the shard, {say(manifest.classes)} in "
                         f"{MANIFEST_NAME} ({len(meta.classes)} vs {len(manifest.classes)} classes): every label "
                         "would be handed out with the wrong name"))
    if samples is not None and meta.count == entry.count:
        lo, hi = entry.start, entry.start + entry.count
        labels, paths = samples[0][lo:hi], samples[1][lo:hi]
        wrong = [j for j in range(meta.count) if labels[j] != meta.labels[j] or paths[j] != meta.paths[j]]
        if wrong:
            j = wrong[0]
            out.append((url, f"{len(wrong)} of its {meta.count} samples have another label or path in "
                             f"{SAMPLES_NAME}, e.g. sample {lo + j} ({meta.paths[j]}): label {meta.labels[j]} in the "
                             f"shard, {labels[j]} ({paths[j]}) in {SAMPLES_NAME}"))
    elif meta.count != entry.count:
        out.append((url, f"the shard holds {meta.count} samples, {MANIFEST_NAME} says {entry.count}"))
    return out


def check_local_manifest(path: Path, reader: StoreReader, *, progress: bool = False) -> list[tuple[str, str]]:
    """A local folder of shards with a ``manifest.json``: the manifest is valid, names the shards the
    folder holds, and (format 2) its ``samples.json.gz`` is there, is the object the manifest names
    (size, sha256, content: ``parse_samples``, as ``verify_remote_shards`` checks it in a bucket) and
    holds the shards' own labels and paths. Nothing local reads that object, but a copy of the folder
    in a bucket hands its labels out before any shard is read, so it is checked before it travels.

    Each shard's ``data.mdb`` must have the manifest's size and sha256, as its copy in a bucket must:
    a node cache refuses a shard whose bytes differ (``ShardIntegrityError``), so a file changed after
    its manifest was written is found here, before it is uploaded. Returns ``(file, problem)`` for
    each that differs (the record pass that follows names the samples it damaged, if any).

    Raises:
        ManifestError: the manifest or the samples object is missing, damaged or replaced (names the file).
    """
    from fastload.errors import ManifestError
    from fastload.store.manifest import SAMPLES_NAME, Manifest, parse_samples

    where = path / MANIFEST_NAME
    manifest = Manifest.from_json(where.read_bytes(), where=str(where))
    named = [(e.name, e.count) for e in manifest.shards]
    held = [(m.path.name, m.count) for m in reader.metas]
    if named != held:
        k = next((i for i, (a, b) in enumerate(zip(named, held)) if a != b), min(len(named), len(held)))

        def say(shards: list[tuple[str, int]]) -> str:
            return "nothing" if k >= len(shards) else f"{shards[k][0]} ({shards[k][1]} samples)"

        raise ManifestError(f"{where}: it names {len(named)} shards, the folder holds {len(held)}; at position {k} "
                            f"the manifest names {say(named)}, the folder holds {say(held)}.\nHINT: the folder and "
                            "its manifest come from different conversions; convert the source again into a new DST.")
    if manifest.samples is None:  # format 1: labels and paths live in the shards only
        return _shard_files_against(path, manifest, progress=progress)
    obj = path / SAMPLES_NAME  # checked first: a small object, where hashing every shard reads the store
    labels, paths = parse_samples(obj.read_bytes() if obj.is_file() else None, manifest, where=str(obj))
    if list(manifest.classes) != list(reader.classes):
        first = next((f"{a!r} vs {b!r}" for a, b in zip(manifest.classes, reader.classes) if a != b), "the count")
        raise ManifestError(f"{where}: its class names are not the shards' ({len(manifest.classes)} vs "
                            f"{len(reader.classes)} classes, first difference: {first}"
                            "): a copy in a bucket would hand every label out with the wrong name.\nHINT: the "
                            "manifest was edited or comes from another conversion; convert the source again "
                            "into a new DST.")
    if labels != reader.labels.tolist() or paths != list(reader.paths):
        first = next(i for i in range(len(labels)) if labels[i] != reader.labels[i] or paths[i] != reader.paths[i])
        raise ManifestError(f"{obj}: sample {first} ({reader.paths[first]}) has label {reader.labels[first]} in its "
                            f"shard, {labels[first]} ({paths[first]}) in {SAMPLES_NAME}: the object matches the "
                            "manifest but not the shards.\nHINT: the folder's files come from different conversions; "
                            "convert the source again into a new DST.")
    return _shard_files_against(path, manifest, progress=progress)


def _shard_files_against(path: Path, manifest, *, progress: bool) -> list[tuple[str, str]]:
    """``(file, problem)`` for each shard file whose size or sha256 differs from the manifest's. Hashed in
    threads (hashlib releases the GIL on large buffers: a disk, not one core, sets the pace)."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    from fastload.store.cache import sha256_file
    from fastload.store.manifest import SHARD_FILE
    from fastload.system import available_cpus

    def check(entry) -> tuple[str, str] | None:
        f = path / entry.name / SHARD_FILE
        size = f.stat().st_size
        if size != entry.bytes:
            return str(f), (f"{size:,} bytes, the manifest says {entry.bytes:,}: the file changed after its "
                            "manifest was written (a copy in a bucket would be refused by every reader)")
        digest = sha256_file(f)
        if digest != entry.sha256:
            return str(f), (f"sha256 {digest[:16]}... differs from the manifest's {entry.sha256[:16]}...: "
                            "the file changed after its manifest was written (a copy in a bucket would be "
                            "refused by every reader)")
        return None

    out = []
    with ThreadPoolExecutor(max(1, min(4, available_cpus()))) as pool, \
            tqdm(total=len(manifest.shards), unit="shard", desc="shards vs manifest", disable=not progress) as bar:
        for problem in pool.map(check, manifest.shards):
            bar.update(1)
            if problem is not None:
                out.append(problem)
    return out
