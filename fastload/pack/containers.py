"""Sources whose images live inside container files: WebDataset tar shards and Parquet files.

Owns: listing them as a ``Source`` (items ``(relpath, label)`` in a fixed order, classes, a
fingerprint) whose locations name a member inside a container, and reading one member's
bytes (``read_member``), locally or in object storage (``store.remote``).

* WebDataset: ``*.tar`` files (a folder or prefix of them, or one file), sorted by name; in each,
  members grouped by key (the name up to the first dot of the basename); a sample is the key's
  image member (``.jpg``, ``.jpeg``, ``.png``, ``.webp``, ...) and its ``.cls`` member (an integer
  label, as text). Relative path: ``<tar name>/<image member name>``. Location:
  ``member:<offset>:<size>:<tar path or URL>``; the bytes are one ranged read.
* Parquet (Hugging Face ``datasets`` layout): ``*.parquet`` files, sorted; an ``image`` column of
  structs ``{bytes, path}`` (or plain binary) and a ``label`` column of integers; class names
  from the ``huggingface`` schema metadata's ``ClassLabel`` names when present. Relative path:
  ``<file name>/<row>`` (with the struct's ``path`` when set). Location:
  ``row:<row group>:<row in group>:<file path or URL>``; a worker keeps the last row group read.

Integer labels (``.cls``, the ``label`` column without ``ClassLabel`` names covering them) make classes
by the file lists' rule (``sources.class_count``): a label far outside the labels seen is refused,
naming its member or row, instead of a list of billions of class names.

Listing reads no image bytes: a tar's 512-byte headers (in 1 KB ranges of a remote object, member
bodies skipped) and its ``.cls`` labels; a Parquet file's footer and its ``label`` and
``image.path`` columns (a row's size, for planning shards, is its row group's average from the footer).

Must not: decode images (``image/`` does) or write stores.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from fastload.errors import SourceError
from fastload.pack.sources import IMG_EXTENSIONS, Source, class_count, open_source, remote_source
from fastload.store import remote

__all__ = ["ContainerSource", "container_source", "is_container_source", "read_member", "open_any_source"]

_IMAGE_COLUMN, _LABEL_COLUMN = "image", "label"


@dataclass(frozen=True)
class ContainerSource(Source):
    """A source whose items are members of containers; ``locations[rel]`` says where each one is."""

    locations: dict[str, str] = field(default_factory=dict, repr=False)
    member_sizes: dict[str, int] = field(default_factory=dict, repr=False)
    containers: tuple[tuple[str, int, str], ...] = ()  # (path or URL, size, version): the fingerprint covers them

    def abspath(self, relpath: str) -> str:
        return self.locations[relpath]

    def sizes(self) -> list[int]:
        return [self.member_sizes.get(rel, 0) for rel, _ in self.items]

    def fingerprint(self, indices: list[int] | None = None) -> str:
        h = hashlib.sha256()
        h.update(self.kind.encode())
        h.update("\0".join(self.classes).encode("utf-8", "surrogateescape"))
        for name, size, version in self.containers:  # version: ETag / last-modified, local mtime
            h.update(f"\n{name}\0{size}\0{version}".encode("utf-8", "surrogateescape"))
        for i in range(len(self.items)) if indices is None else indices:
            rel, label = self.items[i]
            h.update(f"\n{rel}\0{label}\0{self.member_sizes.get(rel, -1)}".encode("utf-8", "surrogateescape"))
        return h.hexdigest()


def _containers(path: str, suffix: str) -> list[tuple[str, int, str]]:
    """``(path or URL, size, version)`` of the container files: version is the object's ETag (else
    last-modified) or the local file's mtime, so one overwritten with same-size bytes is noticed."""
    if remote.is_remote(path):
        if path.rstrip("/").endswith(suffix):
            found = remote.stat(path)
            return [] if found is None else [(path, found[0], found[1])]
        return [(u, s, v) for u, s, v in remote.list_objects(path) if u.endswith(suffix)]
    p = Path(path)

    def local(q: Path) -> tuple[str, int, str]:
        st = q.stat()
        return str(q.resolve()), st.st_size, str(st.st_mtime_ns)

    if p.is_file():
        return [local(p)] if p.name.endswith(suffix) else []
    return [local(q) for q in sorted(p.glob(f"*{suffix}"))]


def is_container_source(path: str) -> str | None:
    """``"webdataset"`` or ``"parquet"`` when ``path`` is (a folder or prefix of) such files, else None."""
    text = str(path).rstrip("/")
    for kind, suffix in (("webdataset", ".tar"), ("parquet", ".parquet")):
        if text.endswith(suffix):
            return kind
    if remote.is_remote(text):
        names = [u for u, _, _ in remote.list_objects(text)]
        if names and all(u.endswith(".tar") for u in names):
            return "webdataset"
        if names and all(u.endswith(".parquet") for u in names):
            return "parquet"
        return None
    p = Path(text)
    if p.is_dir():
        files = [q for q in p.iterdir() if q.is_file() and not q.name.startswith(".")]
        if files and all(q.name.endswith(".tar") for q in files):
            return "webdataset"
        if files and all(q.name.endswith(".parquet") for q in files):
            return "parquet"
    return None


def _open(location: str):
    return remote.open_reader(location) if remote.is_remote(location) else open(location, "rb")


class _RangedFile(io.RawIOBase):
    """A seekable read-only file over an object, fetching only what is read (ranged GETs of at least
    ``block`` bytes from the position read, one cached): listing a tar reads its 512-byte headers and
    skips the member bodies; listing a Parquet file reads its footer and the small columns only."""

    def __init__(self, url: str, size: int, block: int) -> None:
        super().__init__()
        self.url, self.size, self.block = url, size, block
        self.pos = 0
        self.cache_at, self.cache = 0, b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n is None or n < 0 else min(n, self.size - self.pos)
        if n <= 0:
            return b""
        lo = self.pos - self.cache_at
        if not (0 <= lo and lo + n <= len(self.cache)):
            length = min(max(n, self.block), self.size - self.pos)
            self.cache_at, self.cache = self.pos, remote.get_range(self.url, self.pos, length)
            lo = 0
        out = self.cache[lo:lo + n]
        self.pos += len(out)
        return out

    def readinto(self, buf) -> int:
        data = self.read(len(buf))
        buf[:len(data)] = data
        return len(data)


def _open_listing(location: str, size: int, block: int):
    """For listing: a local file, or an object read in small ranges (``_RangedFile``)."""
    return _RangedFile(location, size, block) if remote.is_remote(location) else open(location, "rb")


def _integer_classes(labels: list[int], where: list[str], num_classes: int | None) -> list[str]:
    """``"0" .. "N-1"`` for integer labels (the file lists' rule, ``sources.class_count``); a label far
    outside the labels seen (``2000000000``: a list of billions of class names) is refused, naming its member."""
    limit, why = class_count(labels, num_classes)
    bad = next((i for i, v in enumerate(labels) if v >= limit), None)
    if bad is not None:
        raise SourceError(f"{where[bad]} holds label {labels[bad]}, outside 0..{limit - 1} ({why}).\nHINT: fix the "
                          "label, or give --num-classes N if the dataset really has that many classes.")
    return [str(i) for i in range(limit)]


def _webdataset(path: str, num_classes: int | None = None) -> ContainerSource:
    tars = _containers(path, ".tar")
    if not tars:
        raise SourceError(f"{path}: no .tar files.\nHINT: a WebDataset source is a folder (or prefix) of tar shards.")
    items: list[tuple[str, int]] = []
    where: list[str] = []
    locations: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for tar, tar_size, _ in tars:
        name = tar.rsplit("/", 1)[-1]
        images: dict[str, tarfile.TarInfo] = {}
        labels: dict[str, tarfile.TarInfo] = {}
        # 1 KB ranges: tarfile reads the byte before each header (end-of-data check), then the header;
        # a .cls body right after its header comes in the same range. Image bodies are skipped, unread.
        with _open_listing(tar, tar_size, 1024) as f, tarfile.open(fileobj=f, mode="r:") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                base = m.name.rsplit("/", 1)[-1]
                key = m.name[: len(m.name) - len(base)] + base.split(".", 1)[0]
                ext = "." + base.split(".", 1)[1].lower() if "." in base else ""
                if ext == ".cls":
                    labels[key] = m
                elif ext in IMG_EXTENSIONS and key not in images:
                    images[key] = m
            raw_labels = {}
            for key, m in labels.items():
                f.seek(m.offset_data)
                raw_labels[key] = f.read(m.size)
        for key in sorted(images):
            m = images[key]
            rel = f"{name}/{m.name}"
            if key not in raw_labels:
                raise SourceError(f"{tar}: member {m.name} has no {key}.cls label member.\nHINT: every image of a "
                                  "WebDataset shard needs a .cls member with its integer class.")
            try:
                label = int(raw_labels[key].decode().strip())
            except ValueError:
                raise SourceError(f"{tar}: {key}.cls is not an integer label: {raw_labels[key][:40]!r}") from None
            if label < 0:
                raise SourceError(f"{tar}: {key}.cls holds a negative label {label}")
            items.append((rel, label))
            where.append(f"{tar}: member {key}.cls")
            locations[rel] = f"member:{m.offset_data}:{m.size}:{tar}"
            sizes[rel] = m.size
    if not items:
        raise SourceError(f"{path}: the tar shards hold no image members with a .cls label.")
    classes = _integer_classes([label for _, label in items], where, num_classes)
    return ContainerSource("webdataset", path, path, classes, items, [], locations, sizes, tuple(tars))  # type: ignore[arg-type]


def _class_names(schema) -> list[str] | None:
    meta = (schema.metadata or {}).get(b"huggingface")
    if not meta:
        return None
    try:
        feature = json.loads(meta)["info"]["features"][_LABEL_COLUMN]
        names = feature.get("names")
        return [str(n) for n in names] if names else None
    except (KeyError, TypeError, ValueError):
        return None


def _parquet(path: str, num_classes: int | None = None) -> ContainerSource:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        from fastload.errors import MissingDependencyError

        raise MissingDependencyError("Parquet sources need pyarrow.\nHINT: pip install 'fastload[parquet]'") from None
    files = _containers(path, ".parquet")
    if not files:
        raise SourceError(f"{path}: no .parquet files.")
    items: list[tuple[str, int]] = []
    where: list[str] = []
    locations: dict[str, str] = {}
    sizes: dict[str, int] = {}
    names: list[str] | None = None
    for loc, file_size, _ in files:
        fname = loc.rsplit("/", 1)[-1]
        with _open_listing(loc, file_size, 16 << 10) as f:
            pf = pq.ParquetFile(f)
            schema = pf.schema_arrow
            for col in (_IMAGE_COLUMN, _LABEL_COLUMN):
                if col not in schema.names:
                    raise SourceError(f"{loc}: no {col!r} column (columns: {', '.join(schema.names)}).\nHINT: fastload "
                                      "reads the Hugging Face datasets layout: image {bytes, path} and an int label.")
            names = names or _class_names(schema)
            image_type = schema.field(_IMAGE_COLUMN).type
            has_path = pa.types.is_struct(image_type) and image_type.get_field_index("path") >= 0
            is_struct = pa.types.is_struct(image_type)
            # the image bytes are not read here: only the labels, the struct's path, and each row group's
            # image column size from the footer (a row's size is its row group's average: for planning)
            columns = [_LABEL_COLUMN] + ([f"{_IMAGE_COLUMN}.path"] if has_path else [])
            data_path = f"{_IMAGE_COLUMN}.bytes" if is_struct else _IMAGE_COLUMN
            row = 0
            for rg in range(pf.num_row_groups):
                meta = pf.metadata.row_group(rg)
                nbytes = sum(meta.column(c).total_uncompressed_size for c in range(meta.num_columns)
                             if meta.column(c).path_in_schema == data_path)
                per_row = nbytes // max(1, meta.num_rows)
                table = pf.read_row_group(rg, columns=columns)
                labels = table.column(_LABEL_COLUMN).to_pylist()
                inners = ([img.get("path") if img else None for img in table.column(_IMAGE_COLUMN).to_pylist()]
                          if has_path else [None] * len(labels))
                for j, (inner, label) in enumerate(zip(inners, labels)):
                    rel = f"{fname}/{row:08d}" + (f"-{inner}" if inner else "")
                    if not isinstance(label, int) or label < 0:
                        raise SourceError(f"{loc}: row {row} has label {label!r}; labels must be integers >= 0.")
                    items.append((rel, label))
                    where.append(f"{loc}: row {row} ({_LABEL_COLUMN!r} column)")
                    locations[rel] = f"row:{rg}:{j}:{loc}"
                    sizes[rel] = per_row
                    row += 1
    if not items:
        raise SourceError(f"{path}: the Parquet files hold no rows.")
    top = max(label for _, label in items)
    if names and len(names) > top and num_classes in (None, len(names)):
        classes = names
    else:
        classes = _integer_classes([label for _, label in items], where, num_classes)
    return ContainerSource("parquet", path, path, classes, items, [], locations, sizes, tuple(files))  # type: ignore[arg-type]


def container_source(path: str | os.PathLike[str], *, num_classes: int | None = None) -> ContainerSource:
    """List a WebDataset or Parquet source (a file, a folder or a prefix of them). Integer labels follow
    the file lists' rule (``sources.class_count``): ``num_classes`` when given, and a label far outside the
    labels seen is an error naming its member or row."""
    kind = is_container_source(str(path))
    text = str(path).rstrip("/") if remote.is_remote(str(path)) else str(Path(path).resolve())
    return _webdataset(text, num_classes) if kind == "webdataset" else _parquet(text, num_classes)


_ROW_GROUP: dict[str, object] = {}


def read_member(location: str) -> bytes:
    """The bytes of one ``member:`` (tar) or ``row:`` (Parquet) location."""
    kind, a, b, container = location.split(":", 3)
    if kind == "member":
        start, size = int(a), int(b)
        if remote.is_remote(container):
            return remote.get_range(container, start, size)
        with open(container, "rb") as f:
            f.seek(start)
            return f.read(size)
    import pyarrow.parquet as pq

    key = f"{container}:{a}"
    if _ROW_GROUP.get("key") != key:
        with _open(container) as f:
            _ROW_GROUP["rows"] = pq.ParquetFile(f).read_row_group(int(a), columns=[_IMAGE_COLUMN]).column(
                _IMAGE_COLUMN).to_pylist()
        _ROW_GROUP["key"] = key
    img = _ROW_GROUP["rows"][int(b)]  # type: ignore[index]
    data = img.get("bytes") if isinstance(img, dict) else img
    return bytes(data or b"")


def open_any_source(path: str | os.PathLike[str], *, exclude: tuple[Path, ...] = (),
                    num_classes: int | None = None) -> Source:
    """``open_source`` for local paths, ``remote_source`` for ``s3://`` / ``gs://`` / ``az://`` URLs, and
    ``container_source`` for WebDataset tar shards and Parquet files (local or remote)."""
    from fastload.store.remote import is_remote, listed_once

    with listed_once():  # a remote prefix is listed once, whatever asks
        if is_container_source(str(path)):
            return container_source(path, num_classes=num_classes)
        if is_remote(str(path)):
            return remote_source(str(path), num_classes=num_classes)
    return open_source(path, exclude=exclude, num_classes=num_classes)
