"""Worker processes' ``uint8`` batches written into shared memory they reuse, once the main process let go.

Owns: ``PooledCollate``, the collate a ``fastload.DataLoader`` with worker processes uses in place of
``collate_uint8`` (the same batches, bit for bit), and the release tracking that makes reuse safe.

Why: ``collate_uint8`` in a worker makes each batch in a fresh shared-memory segment, and the kernel
faults in and zeroes every page of it before the images are copied there: about 85 µs per 224 px image
on a 2-core Xeon, 12.8 µs into a segment already faulted in (docs/loader.md). Reused segments gave the
worker-process path about 1.10x (1.07-1.10x per round) on real photos, 2 workers, ``uint8`` batches.

How a segment is known to be free: each worker owns up to ``slots`` segments, and one byte per
segment in a small shared ``flags`` tensor the main process made before the workers started. The
worker sets a segment's byte when it writes a batch there. The batch travels as a ``PooledBatch``
(a tuple whose pickle says which byte is its); where it is unpickled (the main thread, or torch's
pin-memory thread) its images are a tensor over a numpy array of the segment made for that batch
alone, and a finalizer on that array clears the byte when it dies: when the loop, the pin-memory
copy and every view of the batch (``images[0]``, ``images.numpy()``...) have let go.

How a segment travels: only a segment's first batch carries the segment itself (torch's pickle of a
storage: its file descriptor, through a socket and an authentication handshake, then ``mmap``). The
main process keeps that mapping for the pool's life (``_KEPT``), and every later batch in the segment
carries only which segment it is (the pool, the place, the segment's generation there) and its shape:
no socket, no handshake, no ``mmap`` and ``munmap`` (with its TLB shootdown), and no page faults when
the training process reads the batch, per batch: 1.037x (1.024-1.123) the images/s of mapping every
batch afresh where the training process reads each batch's pages (as a copy to the GPU does), 1.010x
(0.956-1.105) where it leaves them unread (4 alternating rounds each, real photos, 2 workers, ``uint8``
batches; ``tools/ab_checkouts.py``, docs/loader.md). The labels travel by value, as a numpy array: as a
tensor, torch would put them in a shared-memory segment of their own per batch (1.03-1.06x, the same tool).
A worker with no free segment, or no room in ``/dev/shm`` for a new one, makes a fresh one as before: it
never waits. A batch the main process never receives (an
epoch cut short) keeps its byte set: that segment is not reused; nothing else changes. Whether this
torch runs the finalizer exactly then is checked once per process (``release_is_tracked``); where it
does not, nothing is reused.

Under a preset that plans (``dataset.plans_samples``: ``train_transform`` on a fastload store), the worker's
``dataset.__getitems__`` hands the collate a ``dataset.PlannedBatch`` instead of made images, and each
image is rendered straight into its slot of the segment: no tensor of its own, no stack (the same bytes;
1.005-1.041x the images/s of rendering then stacking, `uint8` batches, 1.02x channels-last and float,
``tools/bench_batch_memory.py --compare render``).

Must not: reuse a segment any tensor of the main process still views. What it cannot see: a batch the
training process hands to another process. Sent through a ``multiprocessing`` queue or pipe, its images
(not torch shared memory) are moved by torch's pickle into a segment of their own, and the pool's segment
is free again, while a numpy array or DLPack capsule taken from the images (before or after the send:
the queue pickles later, in its feeder thread) still points into it; a worker may write it again. A
process forked while the main process holds a batch maps the segment too. Pass
``reuse_batch_memory=False`` to the loader then, or hand that process a ``.clone()``.
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from fastload.load.dataset import PlannedBatch
from fastload.load.transforms import collate_uint8, uint8_batch_layout
from fastload.load.workers import SHM_PATH, shm_space

__all__ = ["PooledCollate", "PooledBatch", "slots_for", "pool_fits", "release_is_tracked"]

_TOKENS = itertools.count(1)
#: the flags of every live pool in this process, by token (a numpy view of the shared tensor): where a
#: ``PooledBatch`` is unpickled
_FLAGS: weakref.WeakValueDictionary[tuple[int, int], np.ndarray] = weakref.WeakValueDictionary()
#: the segments the main process has received, by pool token, then place: ``(generation, segment)``. Made with
#: the pool (``PooledCollate.__init__``) and dropped with it; a batch still held keeps its own segment mapped
_KEPT: dict[tuple[int, int], dict[int, tuple[int, torch.UntypedStorage]]] = {}
_TRACKS: bool | None = None


def slots_for(prefetch_factor: int | None) -> int:
    """Segments per worker: its batches in flight (``prefetch_factor``), plus the batch the loop holds and the
    one before it, which the loop's variables still refer to while ``next()`` makes the new one."""
    return (prefetch_factor or 2) + 2


def pool_fits(workers: int, slots: int, batch_bytes: int | None, *, path: str = SHM_PATH) -> bool:
    """Whether ``path`` has room for every worker's ``slots`` segments of ``batch_bytes`` at once (True where
    the size or the space is not known). A pool keeps its segments for the worker's life, where a fresh segment
    per batch needs room only for the batches in flight (what ``workers.check_shm`` checks): where the pool's
    would not all fit, the loader makes a fresh segment per batch, as torch does, rather than fill ``/dev/shm``
    with segments kept for later and leave a fresh one no room."""
    space = shm_space(path)
    return not batch_bytes or space is None or workers * slots * batch_bytes <= space[1]


def release_is_tracked() -> bool:
    """Whether a batch's images, as ``_received`` makes them, let go of their numpy array exactly when their last
    view goes (checked once per process, on a shared-memory segment).

    Not before: a view still alive keeps it (else a batch in use could be overwritten); not never: a tensor
    dropped frees it. Torch versions differ in how a tensor made with ``torch.from_numpy`` holds its array;
    where this fails, the loader makes a fresh segment per batch (``collate_uint8``), as torch does.
    """
    global _TRACKS
    if _TRACKS is None:
        try:
            arr = _whole(torch.UntypedStorage._new_shared(64))
            t = torch.from_numpy(arr)
            fired: list[int] = []
            weakref.finalize(arr, fired.append, 1)
            del arr
            view = t[8:].numpy()
            del t
            early = bool(fired)
            del view
            _TRACKS = not early and fired == [1]
        except Exception:  # no shared memory here, or an API this torch lacks: no reuse
            _TRACKS = False
    return _TRACKS


class _Segment:
    """A whole segment as numpy sees it (``__array_interface__``), holding the segment: the array made from it
    keeps the segment mapped, and dies with the last tensor made on it."""

    def __init__(self, segment: torch.UntypedStorage) -> None:
        self.segment = segment
        self.__array_interface__ = {"shape": (segment.nbytes(),), "typestr": "|u1", "version": 3,
                                    "data": (segment.data_ptr(), False)}


def _whole(segment: torch.UntypedStorage) -> np.ndarray:
    """A new numpy array over all of ``segment`` (one per batch: its life is the batch's)."""
    return np.asarray(_Segment(segment))


def _new_segment(nbytes: int) -> torch.UntypedStorage:
    return torch.UntypedStorage._new_shared(nbytes)


def _release(flags: np.ndarray, index: int) -> None:
    flags[index] = 0  # numpy, not a torch op: it may run under any dispatch mode (a torch.compile trace)


def _received(segment: torch.UntypedStorage | None, generation: int, shape: tuple[int, ...],
              strides: tuple[int, ...], labels: np.ndarray, token: tuple[int, int], index: int):
    """A ``PooledBatch`` unpickled: a plain ``(images, labels)`` tuple. ``segment``: the segment, with its first
    batch (kept, where this process made the pool); None: a segment this process kept. The images are a tensor
    over an array made for this batch, and when it dies (the last view of the batch), the segment is free
    again for the worker.

    Raises:
        RuntimeError: a batch in a segment this process never received (the pool's first batch there was
            unpickled in another process).
    """
    kept = _KEPT.get(token)
    if segment is not None:
        if kept is not None:
            kept[index] = (generation, segment)
    else:
        got = kept.get(index) if kept is not None else None
        if got is None or got[0] != generation:
            raise RuntimeError(
                "a worker's batch refers to reused shared memory this process never received (its first batch "
                "was unpickled in another process); pass reuse_batch_memory=False to fastload.DataLoader")
        segment = got[1]
    arr = _whole(segment)
    images = torch.from_numpy(arr).as_strided(shape, strides)
    labels = torch.from_numpy(labels)
    flags = _FLAGS.get(token)
    if flags is not None:  # unpickled elsewhere than the loader's process: the segment stays taken
        weakref.finalize(arr, _release, flags, index).atexit = False  # nothing to free then
    return images, labels


class PooledBatch(tuple):
    """``(images, labels)`` in a reused segment; unpickled as a plain tuple (``_received``). ``first``: the
    segment's first batch at this place, which carries the segment; later ones carry which segment it is."""

    token: tuple[int, int]
    index: int
    generation: int
    first: bool

    def __reduce__(self):
        images, labels = self
        segment = images.untyped_storage() if self.first else None
        # the labels by value (a numpy array pickles its bytes): torch's pickle of a tensor would put 512 bytes in a
        # shared-memory segment of their own, per batch, with the socket, handshake and mmap the images no longer pay
        return _received, (segment, self.generation, tuple(images.shape), tuple(images.stride()), labels.numpy(),
                           self.token, self.index)


class PooledCollate:
    """``collate_uint8`` for one loader's worker processes, into segments each worker reuses.

    Made in the main process before the workers start (``flags``: one byte per worker segment,
    shared); outside a worker (no ``get_worker_info()``) it is ``collate_uint8``.
    """

    def __init__(self, workers: int, slots: int) -> None:
        self.slots = slots
        self.flags = torch.zeros(workers * slots, dtype=torch.uint8).share_memory_()
        self.token = (os.getpid(), next(_TOKENS))
        self._arr = self.flags.numpy()  # reads and writes without torch ops; keeps ``flags`` alive
        _FLAGS[self.token] = self._arr
        _KEPT[self.token] = {}
        weakref.finalize(self, _KEPT.pop, self.token, None)
        self._segments: dict[int, torch.UntypedStorage] = {}
        self._generations: dict[int, int] = {}  # a worker's: segments made at each place so far
        self._largest = 0  # a worker's: the size of the largest segment it made
        self._sent: dict[int, int] = {}  # a worker's: the generation whose segment has travelled, by place

    def __getstate__(self) -> dict:
        return {"slots": self.slots, "flags": self.flags, "token": self.token}  # a worker's segments are its own

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _segments={}, _generations={}, _sent={}, _largest=0,
                             _arr=state["flags"].numpy())

    def __call__(self, batch: Sequence[tuple[torch.Tensor, int]]):
        info = torch.utils.data.get_worker_info()
        if info is None or not batch:
            return collate_uint8(batch)
        layout = batch.layout() if isinstance(batch, PlannedBatch) else None
        writes = layout is not None  # the preset renders each image into its slot: no image of its own, no stack
        if not writes:
            images = [b[0] for b in batch]
            layout = uint8_batch_layout(images)
        n, c, h, w, channels_last = layout
        got = self._take(info.id, n * c * h * w)
        if got is None:  # every segment of this worker is still held: a fresh one, as collate_uint8 makes
            return collate_uint8(batch)
        index, storage = got
        strides = (c * h * w, 1, w * c, c) if channels_last else (c * h * w, h * w, w, 1)
        out = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (n, c, h, w), strides)
        try:
            if writes:
                labels = torch.as_tensor(batch.write_into(out), dtype=torch.int64)
            else:
                torch.stack(images, 0, out=out)
                labels = torch.as_tensor([int(b[1]) for b in batch], dtype=torch.int64)
        except BaseException:
            self._arr[index] = 0
            raise
        result = PooledBatch((out, labels))
        result.token, result.index, result.generation = self.token, index, self._generations[index]
        result.first = self._sent.get(index) != result.generation
        self._sent[index] = result.generation
        return result

    def _take(self, worker: int, nbytes: int) -> tuple[int, torch.UntypedStorage] | None:
        """A free segment of at least ``nbytes`` for this worker, marked taken: the smallest of its own that
        holds it (an epoch's short last batch goes into a full batch's segment), else one made in a free place
        (replacing a free segment too small), as large as the largest this worker made; None when every place
        is taken.

        A segment is replaced only for a batch larger than every free one and every segment made before. The
        main process still maps the old one until the new one's first batch arrives (``_KEPT``), so its room
        comes back only then. With a preset of one output size (the case ``pool_fits`` sizes) every segment is
        a full batch's and nothing is replaced once the first full batch was made.
        """
        first = worker * self.slots
        free = [first + k for k, t in enumerate(self._arr[first:first + self.slots].tolist()) if not t]
        if not free:
            return None
        fits = sorted((i for i in free if i in self._segments and self._segments[i].nbytes() >= nbytes),
                      key=lambda i: self._segments[i].nbytes())
        index = fits[0] if fits else next((i for i in free if i not in self._segments), free[0])
        if not fits:
            self._segments.pop(index, None)  # a free segment too small: this process's mapping of it first
            nbytes = max(nbytes, self._largest)  # a short batch's place made full size: never replaced later
            try:
                self._segments[index] = _new_segment(nbytes)
            except (RuntimeError, OSError):  # /dev/shm full: a fresh segment as collate_uint8 makes, or its error
                return None
            self._generations[index] = self._generations.get(index, 0) + 1
            self._largest = nbytes
        self._arr[index] = 1
        return index, self._segments[index]
