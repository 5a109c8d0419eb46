"""Conversion inputs: an ImageFolder tree or a CSV/TSV file list, as a deterministic list.

Owns: turning a path into ``(relpath, label)`` items and class names in a fixed order, and
a fingerprint that changes when the listing (names, labels, sizes, times) changes, so a
resumed conversion can refuse a source that moved under it.

ImageFolder order is torchvision's exactly (``torchvision.datasets.folder.make_dataset``):
class folders sorted by name, then ``sorted(os.walk(class_dir, followlinks=True))`` and
sorted file names, keeping torchvision's image extensions, case-insensitive. It is
reimplemented here so packing does not import torch; a test pins it to torchvision.

File lists: one ``path,label`` per line (``.tsv``: tab-separated; ``.csv`` or anything
else: comma, unless the first line has a tab), UTF-8 with or without a BOM (anything else
is an error naming the first line that is not UTF-8). An optional header line is skipped,
as are blank lines and lines starting with ``#``. Relative paths resolve against the
list's folder. Labels are integers or class names; if any label is not an integer, all
are names (classes are then the sorted distinct names, and classes with a single sample
are listed in a warning when other classes have 3 or more: they are often typos). Integer labels must lie in ``0..N-1``:
N is ``num_classes`` when given, else the number of distinct labels — a list whose labels
leave gaps (N distinct labels, the largest L > N - 1) is accepted with classes ``0..L``
and the gaps listed in a warning, unless L is far outside (L >= 2N + 100: a typo like
``1000000000`` that would make a billion classes), which is an error naming the line. The
same path listed twice is a warning when both lines agree and an error naming both lines
when their labels differ.

Hostile trees: names that are not valid UTF-8 are kept as Python keeps them
(``surrogateescape``: the original bytes round-trip); directory links that loop back are
walked once; a destination folder inside the tree is left out of the scan; trees of any
depth are walked without recursion. An image file given as the source is refused with a
message saying what a source is.

Must not: decode images (a file given as SRC is only sniffed, to tell an image from a list).
"""

from __future__ import annotations

import csv
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fastload.errors import SourceError

#: torchvision.datasets.folder.IMG_EXTENSIONS
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_HEADER_WORDS = {"path", "file", "filename", "image", "label", "class", "target", "category"}


@dataclass(frozen=True)
class Source:
    """A listed conversion input.

    Attributes:
        kind: ``"imagefolder"`` or ``"filelist"``.
        path: the tree's root or the list file.
        root: folder that relative paths are relative to.
        classes: class names; a label is an index into it.
        items: ``(relpath, label)`` in source order.
    """

    kind: str
    path: Path
    root: Path
    classes: list[str]
    items: list[tuple[str, int]] = field(repr=False)
    warnings: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[tuple[int, str, int]]:
        for i, (rel, label) in enumerate(self.items):
            yield i, rel, label

    def __len__(self) -> int:
        return len(self.items)

    def abspath(self, relpath: str) -> str:
        return os.path.join(self.root, relpath)

    def sizes(self) -> list[int]:
        """Each item's file size in bytes (0 when it cannot be read), in item order."""
        out = []
        for rel, _ in self.items:
            try:
                out.append(os.stat(self.abspath(rel)).st_size)
            except OSError:
                out.append(0)
        return out

    def fingerprint(self, indices: list[int] | None = None) -> str:
        """sha256 over the kind, classes and the given items' (default: all) path, label, size, mtime."""
        h = hashlib.sha256()
        h.update(self.kind.encode())
        h.update("\0".join(self.classes).encode("utf-8", "surrogateescape"))
        for i in range(len(self.items)) if indices is None else indices:
            rel, label = self.items[i]
            try:
                st = os.stat(self.abspath(rel))
                size, mtime = st.st_size, st.st_mtime_ns
            except OSError:
                size, mtime = -1, -1
            h.update(f"\n{rel}\0{label}\0{size}\0{mtime}".encode("utf-8", "surrogateescape"))
        return h.hexdigest()


def _is_image_name(name: str) -> bool:
    return name.lower().endswith(IMG_EXTENSIONS)


def _inside(path: Path, outer: Path) -> bool:
    return path == outer or outer in path.parents


def _walk(top: str, skip: tuple[Path, ...]) -> list[tuple[str, list[str]]]:
    """``(dirpath, file names)`` of every folder under ``top``, as ``os.walk(top, followlinks=True)``
    lists them, but with a stack instead of recursion: a tree thousands of levels deep is walked,
    not a ``RecursionError``. Each real folder is listed once (link loops), and folders inside
    ``skip`` not at all; folders that cannot be listed are passed over, as ``os.walk`` does."""
    out: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    outside = [str(s) for s in skip]
    stack = [(top, os.path.realpath(top))]  # (path, real path): a plain folder's real path is its parent's + name
    while stack:
        dirpath, real = stack.pop()
        if real in seen or any(real == s or real.startswith(s.rstrip(os.sep) + os.sep) for s in outside):
            continue  # a link loop, or the destination store: do not descend
        seen.add(real)
        dirs, files = [], []
        try:
            with os.scandir(dirpath) as it:
                for entry in it:
                    try:
                        is_dir = entry.is_dir()  # follows links, as followlinks=True does
                        link = is_dir and entry.is_symlink()
                    except OSError:
                        is_dir = link = False
                    if is_dir:
                        dirs.append((entry.name, link))
                    else:
                        files.append(entry.name)
        except OSError:
            continue
        out.append((dirpath, files))
        for name, link in reversed(dirs):
            path = os.path.join(dirpath, name)
            stack.append((path, os.path.realpath(path) if link else os.path.join(real, name)))
    return out


def image_folder(root: str | os.PathLike[str], *, exclude: tuple[Path, ...] = ()) -> Source:
    """List an ImageFolder tree in torchvision's order (``exclude``: folders left out, e.g. DST)."""
    root = Path(root).resolve()
    skip = tuple(Path(os.path.realpath(e)) for e in exclude)
    classes = sorted(e.name for e in os.scandir(root)
                     if e.is_dir() and not any(_inside(Path(os.path.realpath(e.path)), s) for s in skip))
    if not classes:
        raise SourceError(
            f"{root}: no class folders found.\nHINT: an ImageFolder tree is ROOT/<class>/<image>; "
            "for a flat folder, write a CSV file list of path,label instead."
        )
    items: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        for dirpath, fnames in sorted(_walk(str(root / name), skip)):
            for fname in sorted(fnames):
                if _is_image_name(fname):
                    items.append((os.path.relpath(os.path.join(dirpath, fname), root), label))
    if not items:
        raise SourceError(f"{root}: no image files ({', '.join(IMG_EXTENSIONS)}) in any class folder.")
    return Source("imagefolder", root, root, classes, items)


def _read_list(path: Path) -> str:
    raw = path.read_bytes()
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise SourceError(f"{path}: the file list is UTF-16; fastload reads UTF-8.\n"
                          f"HINT: iconv -f UTF-16 -t UTF-8 {path} > list-utf8.csv")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        for n, line in enumerate(raw.split(b"\n"), 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise SourceError(
                    f"{path}:{n}: not valid UTF-8 ({exc.reason} at byte {exc.start} of the line): "
                    f"{line[:80]!r}\nHINT: save the list as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8)."
                ) from None
        raise


def _parse_rows(path: Path) -> list[tuple[int, str, str]]:
    text = _read_list(path)
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1)
             if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        raise SourceError(f"{path}: the file list is empty.")
    if path.suffix.lower() == ".tsv" or (path.suffix.lower() != ".csv" and "\t" in lines[0][1]):
        delimiter = "\t"
    else:
        delimiter = ","
    rows = []
    for n, line in lines:
        cells = next(csv.reader([line], delimiter=delimiter))
        cells = [c.strip() for c in cells]
        if len(cells) != 2 or not cells[0] or not cells[1]:
            raise SourceError(
                f"{path}:{n}: expected 2 fields 'path{delimiter}label', got {len(cells)}: {line!r}"
            )
        rows.append((n, cells[0], cells[1]))
    first = rows[0]
    if first[1].lower() in _HEADER_WORDS or first[2].lower() in _HEADER_WORDS:
        rows = rows[1:]
    if not rows:
        raise SourceError(f"{path}: the file list has a header but no entries.")
    return rows


def class_count(labels: list[int], num_classes: int | None = None) -> tuple[int, str]:
    """How many integer classes the labels ``0..N-1`` make, and why (for an error message): ``num_classes``
    when given, else the largest label + 1, unless that is far outside the count of distinct labels
    (largest >= 2 x distinct + 100: a typo like ``2000000000`` would make a list of billions of class
    names), then the count of distinct labels, so that the far label is refused, named by its caller."""
    if num_classes is not None:
        return num_classes, f"--num-classes {num_classes}"
    distinct, top = len(set(labels)), max(labels)
    return (top + 1 if top < 2 * distinct + 100 else distinct), f"{distinct} distinct labels"


def file_list(path: str | os.PathLike[str], *, num_classes: int | None = None) -> Source:
    """List a CSV/TSV file of ``path,label`` lines (the rules are in the module docstring)."""
    path = Path(path).resolve()
    rows = _parse_rows(path)
    root = path.parent
    warnings: list[str] = []

    def as_int(s: str) -> int | None:
        try:
            return int(s)
        except ValueError:
            return None

    ints = [as_int(r[2]) for r in rows]
    if all(v is not None for v in ints):
        labels = [int(v) for v in ints]  # type: ignore[arg-type]
        negative = [r for r, v in zip(rows, labels) if v < 0]
        if negative:
            n, _, lab = negative[0]
            raise SourceError(f"{path}:{n}: label {lab} is negative; labels must be >= 0 or class names.")
        limit, why = class_count(labels, num_classes)
        if max(labels) >= limit:
            n, _, lab = next(r for r, v in zip(rows, labels) if v >= limit)
            raise SourceError(f"{path}:{n}: label {lab} is outside 0..{limit - 1} ({why}).\nHINT: fix the label, "
                              "or give --num-classes N if the dataset really has that many classes.")
        classes = [str(i) for i in range(limit)]
        gaps = sorted(set(range(limit)) - set(labels))
        if gaps:
            shown = ", ".join(map(str, gaps[:20])) + (f" and {len(gaps) - 20} more" if len(gaps) > 20 else "")
            warnings.append(f"{len(gaps)} of {limit} integer classes have no sample: {shown}")
    else:
        classes = sorted({r[2] for r in rows})
        index = {c: i for i, c in enumerate(classes)}
        labels = [index[r[2]] for r in rows]
        if num_classes is not None and len(classes) != num_classes:
            raise SourceError(f"{path}: {len(classes)} distinct class names, but --num-classes {num_classes}.")
        counts: dict[int, int] = {}
        for label in labels:
            counts[label] = counts.get(label, 0) + 1
        singles = [classes[c] for c, k in sorted(counts.items()) if k == 1]
        if singles and max(counts.values()) >= 3:
            warnings.append(f"{len(singles)} class name(s) have a single sample (typos?): "
                            + ", ".join(repr(c) for c in singles[:20]))
    items = []
    first_line: dict[str, tuple[int, int]] = {}
    dupes = 0
    for (n, p, _), label in zip(rows, labels):
        rel = os.path.normpath(p) if not os.path.isabs(p) else p
        seen = first_line.get(rel)
        if seen is not None:
            if seen[1] != label:
                raise SourceError(f"{path}:{n}: {p} is listed again with another label "
                                  f"(line {seen[0]}: {classes[seen[1]]}, line {n}: {classes[label]}).\n"
                                  "HINT: keep one line per file.")
            dupes += 1
        else:
            first_line[rel] = (n, label)
        items.append((rel, label))
    if dupes:
        warnings.append(f"{dupes} file(s) are listed more than once (same label; each copy is stored)")
    return Source("filelist", path, root, classes, items, warnings)


def open_source(path: str | os.PathLike[str], *, exclude: tuple[Path, ...] = (),
                num_classes: int | None = None) -> Source:
    """An ImageFolder tree (a directory; ``exclude`` folders left out) or a file list (a file)."""
    p = Path(path)
    if not p.exists():
        raise SourceError(f"{p} does not exist.")
    if p.is_dir():
        return image_folder(p, exclude=exclude)
    kind = _image_kind(p)
    if kind is not None:
        raise SourceError(
            f"{p} is an image ({kind}), not a source: SRC must be a folder (an ImageFolder tree, "
            "ROOT/<class>/<image>) or a file list (CSV/TSV lines of path,label).\nHINT: pass the folder that "
            "holds the class folders, or write a file list naming the images."
        )
    return file_list(p, num_classes=num_classes)


def _image_kind(path: Path) -> str | None:
    """The image format of ``path``, or None: its magic bytes say an image and it is binary (a NUL
    byte, or not UTF-8, in its first 4 KB), so a list whose first path starts "BM" stays a list."""
    from fastload.image.formats import sniff

    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    kind = sniff(head)
    if kind is None:
        return None
    try:
        head.decode("utf-8")
        binary = b"\0" in head
    except UnicodeDecodeError as exc:
        binary = exc.start < len(head) - 4  # not just a character cut at the 4 KB boundary
    return kind.upper() if binary else None


@dataclass(frozen=True)
class RemoteSource(Source):
    """A source in object storage: ``root`` is the URL prefix, sizes come from the listing."""

    object_sizes: dict[str, int] = field(default_factory=dict, repr=False)
    object_versions: dict[str, str] = field(default_factory=dict, repr=False)  # ETag or last-modified

    def abspath(self, relpath: str) -> str:
        return f"{str(self.root).rstrip('/')}/{relpath}"

    def sizes(self) -> list[int]:
        return [self.object_sizes.get(rel, 0) for rel, _ in self.items]

    def fingerprint(self, indices: list[int] | None = None) -> str:
        """sha256 over the kind, classes and the given items' (default: all) key, label, size and version
        (ETag, else last-modified: an object overwritten with other bytes of the same size changes it)."""
        h = hashlib.sha256()
        h.update(self.kind.encode())
        h.update("\0".join(self.classes).encode("utf-8", "surrogateescape"))
        for i in range(len(self.items)) if indices is None else indices:
            rel, label = self.items[i]
            h.update(f"\n{rel}\0{label}\0{self.object_sizes.get(rel, -1)}\0{self.object_versions.get(rel, '')}"
                     .encode("utf-8", "surrogateescape"))
        return h.hexdigest()


def remote_source(url: str, *, num_classes: int | None = None) -> RemoteSource:
    """An ImageFolder layout under an object-store prefix (``s3://bucket/prefix/<class>/<image>``),
    or a file list object (``.csv``/``.tsv``) whose paths are keys relative to the list's prefix."""
    import tempfile

    from fastload.store import remote

    url = url.rstrip("/")
    if url.lower().endswith((".csv", ".tsv", ".txt")):
        base = url.rsplit("/", 1)[0]
        with tempfile.TemporaryDirectory(prefix="fastload-list-") as tmp:
            local = Path(tmp) / url.rsplit("/", 1)[1]
            remote.download_file(url, local)
            listed = file_list(local, num_classes=num_classes)
        rels = [rel for rel, _ in listed.items]
        meta = {u: (size, version) for u, size, version in remote.list_objects(base)}
        object_sizes = {rel: meta.get(f"{base}/{rel}", (-1, ""))[0] for rel in rels}
        versions = {rel: meta.get(f"{base}/{rel}", (-1, ""))[1] for rel in rels}
        return RemoteSource("filelist", url, base, listed.classes, listed.items,  # type: ignore[arg-type]
                            list(listed.warnings), object_sizes, versions)
    objects = remote.list_objects(url)
    if not objects:
        raise SourceError(f"{url}: no objects under this prefix.\nHINT: an ImageFolder layout is "
                          "PREFIX/<class>/<image>; check the bucket and prefix.")
    rel_sizes = {u[len(url) + 1:]: size for u, size, _ in objects}
    rel_versions = {u[len(url) + 1:]: version for u, _, version in objects}
    by_class: dict[str, list[str]] = {}
    for rel in rel_sizes:
        if "/" in rel and _is_image_name(rel):
            by_class.setdefault(rel.split("/", 1)[0], []).append(rel)
    classes = sorted(by_class)
    if not classes:
        raise SourceError(f"{url}: no image files ({', '.join(IMG_EXTENSIONS)}) in any class folder.\nHINT: an "
                          "ImageFolder layout is PREFIX/<class>/<image>.")
    items = [(rel, label) for label, name in enumerate(classes) for rel in sorted(by_class[name])]
    return RemoteSource("imagefolder", url, url, classes, items, [],  # type: ignore[arg-type]
                        {rel: rel_sizes[rel] for rel, _ in items}, {rel: rel_versions[rel] for rel, _ in items})
