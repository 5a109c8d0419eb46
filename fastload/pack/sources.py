"""Conversion inputs: an ImageFolder tree or a CSV/TSV file list, as a deterministic list.

Owns: turning a path into ``(relpath, label)`` items and class names in a fixed order, and
a fingerprint that changes when the listing (names, labels, sizes, times) changes, so a
resumed conversion can refuse a source that moved under it.

ImageFolder order is torchvision's exactly (``torchvision.datasets.folder.make_dataset``):
class folders sorted by name, then ``sorted(os.walk(class_dir, followlinks=True))`` and
sorted file names, keeping torchvision's image extensions, case-insensitive. It is
reimplemented here so packing does not import torch; a test pins it to torchvision.

File lists: one ``path,label`` per line (``.tsv``: tab-separated; ``.csv`` or anything
else: comma, unless the first line has a tab). An optional header line is skipped, as are
blank lines and lines starting with ``#``. Relative paths resolve against the list's
folder. Labels are integers (classes are then ``"0".."max"``) or class names (classes are
the sorted distinct names); if any label is not an integer, all are names.

Must not: open or decode images.
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

    def __iter__(self) -> Iterator[tuple[int, str, int]]:
        for i, (rel, label) in enumerate(self.items):
            yield i, rel, label

    def __len__(self) -> int:
        return len(self.items)

    def abspath(self, relpath: str) -> str:
        return os.path.join(self.root, relpath)

    def fingerprint(self, indices: list[int] | None = None) -> str:
        """sha256 over the kind, classes and the given items' (default: all) path, label, size, mtime."""
        h = hashlib.sha256()
        h.update(self.kind.encode())
        h.update("\0".join(self.classes).encode())
        for i in range(len(self.items)) if indices is None else indices:
            rel, label = self.items[i]
            try:
                st = os.stat(self.abspath(rel))
                size, mtime = st.st_size, st.st_mtime_ns
            except OSError:
                size, mtime = -1, -1
            h.update(f"\n{rel}\0{label}\0{size}\0{mtime}".encode())
        return h.hexdigest()


def _is_image_name(name: str) -> bool:
    return name.lower().endswith(IMG_EXTENSIONS)


def image_folder(root: str | os.PathLike[str]) -> Source:
    """List an ImageFolder tree in torchvision's order."""
    root = Path(root).resolve()
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise SourceError(
            f"{root}: no class folders found.\nHINT: an ImageFolder tree is ROOT/<class>/<image>; "
            "for a flat folder, write a CSV file list of path,label instead."
        )
    items: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        for dirpath, _, fnames in sorted(os.walk(root / name, followlinks=True)):
            for fname in sorted(fnames):
                if _is_image_name(fname):
                    items.append((os.path.relpath(os.path.join(dirpath, fname), root), label))
    if not items:
        raise SourceError(f"{root}: no image files ({', '.join(IMG_EXTENSIONS)}) in any class folder.")
    return Source("imagefolder", root, root, classes, items)


def _parse_rows(path: Path) -> list[tuple[int, str, str]]:
    text = path.read_text(encoding="utf-8-sig")
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


def file_list(path: str | os.PathLike[str]) -> Source:
    """List a CSV/TSV file of ``path,label`` lines."""
    path = Path(path).resolve()
    rows = _parse_rows(path)
    root = path.parent

    def as_int(s: str) -> int | None:
        try:
            return int(s)
        except ValueError:
            return None

    ints = [as_int(r[2]) for r in rows]
    if all(v is not None for v in ints):
        negative = [r for r, v in zip(rows, ints) if v < 0]  # type: ignore[operator]
        if negative:
            n, _, lab = negative[0]
            raise SourceError(f"{path}:{n}: label {lab} is negative; labels must be >= 0 or class names.")
        classes = [str(i) for i in range(max(ints) + 1)]  # type: ignore[type-var]
        labels = [int(v) for v in ints]  # type: ignore[arg-type]
    else:
        classes = sorted({r[2] for r in rows})
        index = {c: i for i, c in enumerate(classes)}
        labels = [index[r[2]] for r in rows]
    items = []
    for (_, p, _), label in zip(rows, labels):
        rel = os.path.normpath(p) if not os.path.isabs(p) else p
        items.append((rel, label))
    return Source("filelist", path, root, classes, items)


def open_source(path: str | os.PathLike[str]) -> Source:
    """An ImageFolder tree (a directory) or a file list (a file)."""
    p = Path(path)
    if not p.exists():
        raise SourceError(f"{p} does not exist.")
    if p.is_dir():
        return image_folder(p)
    return file_list(p)
