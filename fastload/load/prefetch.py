"""``DevicePrefetcher``: batches onto the device ahead of use, normalised there.

Owns: overlapping the host→device copy of batch i+1 with the compute of batch i, and
turning ``uint8`` images into normalised floats on the device.

On CUDA the next batch is copied on a side stream with ``non_blocking=True`` (from pinned
memory, so the copy is truly asynchronous), converted and normalised on that stream; the
compute stream waits for it only when the batch is handed out, and ``record_stream``
tells the caching allocator that the compute stream uses the memory, so it is not reused
while the step still reads it. On CPU the next batch is normalised on a helper thread while
the caller's step runs (numpy's cast-multiply and add release the GIL, so it runs beside a
step that holds it): normalising in the calling thread put 5-8 ms per batch of 64 on the
step's critical path, where a GPU would have done it asynchronously (docs/loader.md, "The CPU
normalisation off the step's critical path"). Either way the batch contract is the same
everywhere: ``(images float NCHW normalised, labels int64)`` on the requested device.

Both devices take the loader's next batch in the calling thread (so a profiler timing the
loader's ``next()`` sees the waits the step sees) and hold one prepared batch ahead (so a
loader that rewrites its last batch's memory on the next ``next()`` needs ``ahead=False``); a
loader error is raised after the batches before it are handed out. ``ahead=False``: each
batch prepared when asked for, in the calling thread, nothing held ahead (a ``state_dict`` of
the loader then counts exactly the batches handed out). Other devices (MPS, XPU) are prepared
in the calling thread, as with ``ahead=False``: two threads' ops at once are not safe on all of
them.

On CPU the normalised images are written into one of a few reused float32 buffers (two, three
with a batch prepared ahead: the one the step holds, the one ready, the one being written) when
nothing holds that buffer's last batch any more (a batch kept by the step, any view or array of
it, or its storage object keeps its buffer out of use), else into a fresh one: a fresh 38 MB
for every batch of 64 at 224 px cost more in page faults than the normalisation itself
(``OutputBuffers``).

``uint8`` images are normalised with ``mean``/``std``. Float images are taken as already
normalised (a torchvision ``ToTensor() + Normalize()`` pipeline) and only moved and cast.

Must not: iterate the loader more than one batch ahead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from fastload.load import reuse
from fastload.load.transforms import IMAGENET_MEAN, IMAGENET_STD, normalize

__all__ = ["DevicePrefetcher", "prepare_batch", "OutputBuffers"]

_END = object()  # the loader is exhausted (a batch may be anything, None included)


class OutputBuffers:
    """Float32 CPU buffers for normalised batches, reused once nothing else holds them.

    ``take(shape, channels_last)`` gives a tensor on a pooled buffer that nothing outside the pool
    holds (``reuse.py``'s rule: no tensor, view, array or storage object of its last batch, and
    never one shared with another process), else a fresh one (pooled while fewer than ``keep`` are,
    or in place of an idle pooled buffer of another shape). Allocated through numpy, which backs
    large arrays with transparent huge pages.
    """

    def __init__(self, keep: int = 2) -> None:
        import threading

        self.keep = keep
        self.pool: list[tuple[torch.Tensor, bool, tuple[int, int]]] = []
        self._lock = threading.Lock()  # two threads iterating one prefetcher never get one buffer

    def take(self, shape: tuple[int, ...], channels_last: bool) -> torch.Tensor:
        import numpy as np

        with self._lock:
            self.pool = [e for e in self.pool if not e[0].is_shared()]  # another process's now
            for buf, cl, mark in self.pool:
                if buf.shape == shape and cl == channels_last and reuse.idle(buf, mark):
                    return buf[:]  # a new tensor on the storage: while it is held, the use count shows it
            n, c, h, w = shape
            if channels_last:
                buf = torch.from_numpy(np.empty((n, h, w, c), dtype=np.float32)).permute(0, 3, 1, 2)
            else:
                buf = torch.from_numpy(np.empty(shape, dtype=np.float32))
            if not reuse.trackable():
                return buf
            if len(self.pool) >= self.keep:  # full: an idle buffer of another shape makes room, else no pooling
                other = next((e for e in self.pool if reuse.idle(e[0], e[2])), None)
                if other is None:
                    return buf
                # by identity: list.remove compares entries with ==, which on tensors is elementwise
                self.pool = [e for e in self.pool if e is not other]
            self.pool.append((buf, channels_last, reuse.holders(buf)))
            return buf[:]


def prepare_batch(batch, device: torch.device, *, mean: Sequence[float] = IMAGENET_MEAN,
                  std: Sequence[float] = IMAGENET_STD, dtype: torch.dtype | None = torch.float32,
                  channels_last: bool = False, non_blocking: bool = False, buffers: OutputBuffers | None = None):
    """One ``(images, labels, ...)`` batch onto ``device`` under the batch contract.

    ``uint8`` images are normalised there (to ``dtype``, float32 when None); float images
    are taken as normalised and only cast to ``dtype`` (kept as they are when None).
    Labels become int64; extra tensors are moved along. ``buffers``: where ``uint8`` images on
    the CPU are normalised to float32 (``OutputBuffers``; None: a fresh tensor).
    """
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise TypeError(f"expected (images, labels, ...) batches, got {type(batch).__name__}")
    images, labels, *rest = batch
    images = images.to(device, non_blocking=non_blocking)
    if images.dtype == torch.uint8:
        out = None
        if buffers is not None and images.device.type == "cpu" and images.dim() == 4 and dtype in (None, torch.float32):
            out = buffers.take(tuple(images.shape), channels_last)
        images = normalize(images, mean, std, dtype=dtype or torch.float32, channels_last=channels_last, out=out)
    else:
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        if dtype is not None:
            images = images.to(dtype)
    labels = torch.as_tensor(labels).to(device, dtype=torch.int64, non_blocking=non_blocking)
    rest = [r.to(device, non_blocking=non_blocking) if isinstance(r, torch.Tensor) else r for r in rest]
    return (images, labels, *rest)


class DevicePrefetcher:
    """Wrap any loader of ``(images, labels)`` batches.

    Args:
        loader: an iterable of ``(images, labels, ...)``; extra tensors are moved too.
        device: target device (default: ``cuda`` when available, else ``cpu``).
        mean, std: per-channel normalisation, on the 0..1 scale.
        dtype: floating dtype of the images handed out (``torch.bfloat16`` for AMP).
        channels_last: hand out images in ``torch.channels_last`` memory format.
        ahead: prepare the next batch while the caller uses this one (CUDA: copied and normalised on
            a side stream; CPU: normalised on a helper thread), so one batch is taken from the loader
            ahead. False: each batch is prepared when asked for, in the calling thread, and none is
            held ahead (what a resumable loop that saves the loader's state between steps wants).

    On the CPU a float32 batch is written into a buffer reused from an earlier batch once nothing
    holds that batch any more (a tensor, view, array or storage object of it), so keeping a batch
    is always safe; a batch moved to shared memory for another process leaves the reuse.
    """

    def __init__(self, loader: Iterable, device: str | torch.device | None = None, *,
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 dtype: torch.dtype = torch.float32, channels_last: bool = False, ahead: bool = True) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating type, got {dtype}")
        if len(mean) != len(std):
            raise ValueError(f"mean and std need the same length, got {len(mean)} and {len(std)}")
        self.loader = loader
        from fastload.system import resolve_device

        self.device = resolve_device(device, what="DevicePrefetcher's device")
        self.mean, self.std = tuple(mean), tuple(std)
        self.dtype, self.channels_last, self.ahead = dtype, channels_last, bool(ahead)
        # ahead: the batch the step holds, the one ready, the one being written
        self._buffers = OutputBuffers(keep=3 if self.ahead else 2) if self.device.type == "cpu" else None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def _prepare(self, batch, non_blocking: bool):
        return prepare_batch(batch, self.device, mean=self.mean, std=self.std, dtype=self.dtype,
                             channels_last=self.channels_last, non_blocking=non_blocking, buffers=self._buffers)

    def __iter__(self) -> Iterator:
        if not self.ahead or self.device.type not in ("cpu", "cuda"):  # another device: prepared where asked
            for batch in self.loader:
                yield self._prepare(batch, non_blocking=False)
        elif self.device.type == "cuda":
            yield from self._iter_cuda()
        else:
            yield from self._iter_host()

    def _one_ahead(self, start: Callable[[Any], Any], finish: Callable[[Any], Any]) -> Iterator:
        """Both devices' order: once batch i is ready (``finish``), batch i+1 is taken from the loader in the
        calling thread and ``start``-ed, then batch i is handed out, so batch i+1 is prepared while the
        caller's step runs on batch i. The loader is never more than one batch ahead, and its error is
        raised once the batch before it is handed out."""
        it = iter(self.loader)
        try:
            batch = next(it)
        except StopIteration:
            return
        pending = start(batch)
        while pending is not _END:
            ready = finish(pending)
            failed = None
            try:
                batch = next(it)
            except StopIteration:
                batch = _END
            except Exception as exc:  # the loader's: raised once the batch before it is handed out
                batch, failed = _END, exc
            pending = _END if batch is _END else start(batch)
            batch = None  # the raw batch is start's now: drop this frame's reference
            yield ready
            del ready
            if failed is not None:
                raise failed

    def _iter_host(self) -> Iterator:
        """CPU: batches normalised on a helper thread. The helper only normalises (it never waits for the
        loader), so closing the iterator, or the interpreter's exit, waits at most for one batch's
        normalisation. Where the helper cannot start (threads no longer take work once the interpreter's
        main thread has ended: a loop trained in another thread, or run from an exit handler), the batch is
        prepared in the calling thread."""
        import threading
        from concurrent.futures import Future, ThreadPoolExecutor

        helper_ids: set[int] = set()
        helper = ThreadPoolExecutor(1, thread_name_prefix="fastload-prefetch",  # its thread starts on a batch
                                    initializer=lambda: helper_ids.add(threading.get_ident()))

        def start(batch) -> Future:
            try:
                return helper.submit(self._prepare, batch, False)
            except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
                done: Future = Future()
                try:
                    done.set_result(self._prepare(batch, False))
                except Exception as exc:
                    done.set_exception(exc)
                return done

        try:
            yield from self._one_ahead(start, lambda future: future.result())
        finally:
            # closed from the helper itself (a garbage collection that ran there): it cannot wait for itself
            helper.shutdown(wait=threading.get_ident() not in helper_ids, cancel_futures=True)

    def _iter_cuda(self) -> Iterator:
        """CUDA: batches copied and normalised on a side stream; the compute stream waits for a batch only
        when it is handed out, and ``record_stream`` keeps its memory from reuse while the step reads it."""
        stream = torch.cuda.Stream(self.device)

        def start(batch):
            with torch.cuda.stream(stream):
                return self._prepare(batch, non_blocking=True)

        def finish(ready):
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(stream)
            for t in ready:
                if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                    t.record_stream(current)
            return ready

        yield from self._one_ahead(start, finish)
