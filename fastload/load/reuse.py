"""When a pooled batch buffer may be written again: only when nothing outside its pool holds it.

Owns: the one rule both buffer pools follow (the thread pipeline's ``uint8`` batch buffers in
``threads.py``, ``DevicePrefetcher``'s normalised float32 outputs on the CPU in ``prefetch.py``).
A buffer is held while anything but the pool refers to its storage: a tensor or a view of it
(torch's storage use count: ``.numpy()`` arrays, slices, channels-last views and the tensors
autograd saves all keep one), the storage object itself (``x.untyped_storage()``, which the use
count misses: its Python reference count), or another process (a buffer moved to shared memory by
``share_memory_()`` or a ``torch.multiprocessing`` queue: it is never reused). The use count is a
private torch function: without it, nothing is reused.

Must not: allocate buffers (each pool allocates its own kind).
"""

from __future__ import annotations

import sys

import torch

__all__ = ["trackable", "holders", "idle"]

_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def trackable() -> bool:
    """Whether this torch lets a pool see who holds a buffer (else: never reuse one)."""
    return _USE_COUNT is not None


def holders(buf: torch.Tensor) -> tuple[int, int]:
    """What refers to ``buf``'s storage now: (tensors on it, references to the storage object).
    Taken while the pool alone holds ``buf``, it is the mark ``idle`` compares with."""
    st = buf.untyped_storage()
    return _USE_COUNT(st._cdata), sys.getrefcount(st)


def idle(buf: torch.Tensor, mark: tuple[int, int]) -> bool:
    """Nothing but the pool holds ``buf`` (``mark``: its ``holders`` then), and no other process can."""
    return not buf.is_shared() and holders(buf) == mark
