"""A cold page cache on demand: evict a dataset's files, then check they are gone.

Owns: dropping files from the kernel's page cache with
``os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)`` (no root needed, unlike
``/proc/sys/vm/drop_caches``; dirty pages are written back first with ``fdatasync`` so
they can be dropped), and measuring how much of them is still resident with ``mincore``
on a read-only mapping (ctypes, Linux). A recipe with ``[dataset] cache = "cold"`` calls
``evict`` before every stage of every round, so each stage reads from the device.

The kernel does not drop pages another process has mapped, and on tmpfs or some network
file systems the call is a no-op: the check says so instead of assuming success.

Must not: run stages or print.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["Eviction", "evict", "resident_bytes", "files_under", "CONFIRM_FRACTION"]

#: At most this share of the files' bytes may still be resident for eviction to count as confirmed.
CONFIRM_FRACTION = 0.02


@dataclass
class Eviction:
    """What ``evict`` did: files, their bytes, what stayed resident (None: not measurable)."""

    files: int
    bytes: int
    resident_before: int | None
    resident_after: int | None
    confirmed: bool
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def files_under(paths: Iterable[Path | None]) -> list[Path]:
    """Every regular file of the given files / folders (recursively), each once."""
    out: dict[Path, None] = {}
    for p in paths:
        if p is None:
            continue
        p = Path(p)
        if p.is_file():
            out[p] = None
        elif p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.is_file():
                    out[f] = None
    return list(out)


def _libc():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return libc


_LIBC: list[Any] = []


def resident_bytes(path: Path) -> int | None:
    """Bytes of ``path`` in the page cache now (``mincore``), or None where it cannot be asked."""
    if not _LIBC:
        _LIBC.append(_libc() if hasattr(os, "posix_fadvise") else None)
    libc = _LIBC[0]
    if libc is None:
        return None
    size = path.stat().st_size
    if size == 0:
        return 0
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                return None
            return min(size, sum(v & 1 for v in vec) * page)
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            os.fdatasync(fd)  # dirty pages cannot be dropped; a freshly written store has them
        except OSError:
            pass
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def evict(files: Iterable[Path]) -> Eviction:
    """Drop ``files`` from the page cache and measure what is left resident."""
    files = list(files)
    total = sum(f.stat().st_size for f in files)
    if not hasattr(os, "posix_fadvise"):
        return Eviction(len(files), total, None, None, False, "posix_fadvise is not available on this OS")

    def resident() -> int | None:
        sizes = [resident_bytes(f) for f in files]
        return None if any(s is None for s in sizes) else sum(sizes)  # type: ignore[misc]

    before = resident()
    for f in files:
        _drop(f)
    after = resident()
    if after is None:
        return Eviction(len(files), total, before, None, False, "mincore is not available: eviction not confirmed")
    confirmed = after <= CONFIRM_FRACTION * total
    note = "" if confirmed else (f"{after / max(1, total):.0%} of the files stayed in the page cache (tmpfs, a "
                                 "network file system, or pages another process has mapped)")
    return Eviction(len(files), total, before, after, confirmed, note)
