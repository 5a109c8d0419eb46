"""The worker-free pipeline: ``fastload.DataLoader(..., backend="threads")``.

Owns: ``ThreadBatchIterator``, one epoch of batches made by a pool of threads of the
training process: no worker processes, no pickling, no ``/dev/shm``.

Why threads work here: the expensive parts of fastload's presets (libjpeg-turbo through
simplejpeg, the region decoders, torch's resize kernel) release the GIL, so N
threads decode on N cores. What they save over worker processes: the shared-memory
segment per batch, pickling, the page faults of a fresh batch every step, and a copy of
the dataset object per worker.

Two paths, chosen per loader:

* **Fast path**: an ``LMDBImageDataset`` whose transform is a fastload preset (has
  ``from_bytes`` and an integer ``size``), no ``target_transform``, and the default (or
  ``collate_uint8``) collate. Each task writes its samples' ``uint8`` CHW images straight into
  their slots of the batch buffer, so there is no collate (fastload's train preset resizes an
  unflipped image into the slot itself, ``from_bytes(..., out=slot)``; other images are copied
  in). A task is one sample, or, when the preset plans (``plan``/``render``, the train preset),
  a run of up to ``PLAN_RUN`` samples: their records are read and their crops drawn back to back
  (short steps that take the GIL), then each is decoded and resized (long steps without it), so
  two threads overlap one's planning with the other's decoding (1.12-1.19x the images/s on real
  photos, ``tools/channels_last_ab.py --compare plan``). A sample whose plan or render fails is
  redone by ``getitem``, which names it and applies ``on_error``, so the batches are the same.
  Buffers are reused, and reuse is safe by construction rather than by a contract the
  user must remember: a batch handed out is the caller's for as long as it holds it,
  exactly as with torch's DataLoader. The buffer is ``torch.channels_last`` when the preset
  is (``channels_last=True``) and the collate ``collate_uint8``, as that collate makes it
  under worker processes; under ``default_collate`` it is contiguous NCHW, as torch's is.

  - Without CUDA, buffers come from a small pool; a buffer is refilled only when no
    tensor anywhere (the batch, a view or a numpy array of it) still uses its storage
    (checked with the storage's use count). If every pooled buffer is still held, a
    fresh one is allocated.
  - With CUDA and ``pin_memory``, every batch is ``torch.empty(..., pin_memory=True)``:
    torch's caching host allocator hands back a freed pinned block of the same size, and
    only once the asynchronous copies recorded on it (``DevicePrefetcher``'s side-stream
    ``non_blocking`` copy) have completed. So composing with ``DevicePrefetcher`` never
    overwrites a batch still being copied, and the pinned pages are reused, not re-faulted.

* **Generic path**: any other map-style dataset or collate: each task runs
  ``dataset[i]``; the thread finishing a batch's last sample runs ``collate_fn`` (and pins
  when asked). An ``LMDBImageDataset`` with a preset is still seeded per sample (below);
  otherwise determinism depends on the dataset (torch's global RNG is shared by all
  threads, so a transform drawing from it gives crops that depend on scheduling).

Determinism and resume: the iterator runs on the loader's epoch record (``loader.py``,
``_resume_iter.py``), exactly as torch's iterators do under ``backend="processes"``: the
epoch's order comes from the loader's (resumable) index sampler, and each sample's random
draws (crop box, flip) from its own ``torch.Generator`` seeded with
``mix_seed(sample seed, epoch, index)`` (``state.py``): the very seed the processes backend
seeds torch's RNG with for that sample. The epoch's sample seed is the first draw of the
iterator (one ``random_`` from the loader's ``generator``, else from the global RNG, after
the sampler's iterator is made, as torch draws its ``_base_seed``), derived from the
``DistributedSampler``'s seed under one, or the saved one on resume. So the same seed gives
the same samples in the same batches with the same crops whatever the thread count,
including 0 (decoding in the calling thread), and the same as ``backend="processes"``; a
state saved by either backend resumes on the other. Seeded samples: the fast path, and the
generic path over an ``LMDBImageDataset`` with a preset (``getitem(i, generator=...)``).

The loader's ``state_dict()`` counts the batches handed to the caller (``__next__``
returned them), never those the threads have filled ahead; the order is drawn when the
iterator is made (the first indices are taken then, as torch's worker iterator does), so a
state taken between ``iter()`` and the first ``next()`` already pins the epoch's order.

Bounded: at most ``prefetch_factor`` (default 2) batches are being filled ahead of the
one handed out. Under the loader's autotuner (``autotune.py``), the thread count and that
depth change between batches: threads are added at once and surplus ones end after their
current sample, so no sample is lost, repeated or reordered, and resume is unchanged.

Shutdown: the end of an epoch, ``close()``, or dropping the iterator stops the pool and
joins its threads, for at most ``JOIN_TIMEOUT_S`` in all (torch gives a worker process as
long before terminating it); the threads hold no reference to the iterator, so an iterator
abandoned mid-epoch is collected and its threads end. ``timeout > 0``: a batch not ready
within it raises torch's "DataLoader timed out after N seconds" (naming the samples still
being read) at once, without waiting for the stuck thread; that daemon thread ends when its
read returns, and never keeps the process from exiting. At interpreter exit the pools of all iterators still
alive are stopped first (their threads end after their current sample): a daemon thread left
inside a torch or decoder call while CPython finalises would abort the process. Their threads
are waited for within one budget shared with fastload's other exit handlers
(``exiting.wait_left``: ``JOIN_TIMEOUT_S`` at most for one pool, ``EXIT_BUDGET_S`` for all, but
``EXIT_FLOOR_S`` at least, for a thread finishing an ordinary sample).

torch's process-only arguments: ``persistent_workers`` and ``multiprocessing_context`` have
nothing to act on (a pool starts per epoch, in microseconds); batches always come in
sampler order (``in_order=False`` would only reorder them); ``worker_init_fn`` and
``IterableDataset`` are refused with the fix (``check_thread_backend``).

Must not: start processes, touch ``/dev/shm``, or copy to the device (that is
``DevicePrefetcher``'s job).
"""

from __future__ import annotations

import atexit
import ctypes
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torch.utils.data._utils.collate import default_collate

from fastload import exiting
from fastload.load import reuse
from fastload.load.dataset import PLAN_RUN, LMDBImageDataset, item_from_plan, plans_samples, put_in_slot, try_plan
from fastload.load.replay import mix_seed
from fastload.load.transforms import (accepts_keyword, collate_uint8, is_preset, preset_channels_last,
                                      preset_size, preset_writes_into)

__all__ = ["ThreadBatchIterator", "check_thread_backend"]

# How long closing a pool waits for its threads, all of them together: torch's
# ``_shutdown_workers`` gives a worker process MP_STATUS_CHECK_INTERVAL (5 s) to exit before
# terminating it. A thread cannot be terminated, so one still stuck after this (a read that
# never returns) is left behind: it is a daemon thread that holds no reference to the
# iterator, returns as soon as its read does (the pool is stopping), and does not keep the
# process from exiting.
JOIN_TIMEOUT_S = 5.0
# at exit, what a pool's threads get even when other exit handlers used up the shared budget (``exiting``):
# a thread in the middle of an ordinary sample ends within it, so it is not left inside a decoder call
EXIT_FLOOR_S = 0.5


def check_thread_backend(loader) -> None:
    """Refuse, with the fix, what the thread backend cannot honour (called by ``DataLoader``).

    Raises:
        ValueError: an ``IterableDataset`` or a ``worker_init_fn`` with ``backend="threads"``.
    """
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            "backend='threads' needs a map-style dataset (with __getitem__ and __len__); got the "
            f"IterableDataset {type(loader.dataset).__name__}.\nHINT: use backend='processes' for "
            "iterable datasets.")
    if loader.worker_init_fn is not None:
        raise ValueError(
            "worker_init_fn is called once per worker process; backend='threads' starts no worker "
            "processes.\nHINT: do the set-up before creating the DataLoader, or use backend='processes'.")


def _own_getitem(ds) -> bool:
    """An ``LMDBImageDataset`` whose ``dataset[i]`` is fastload's (a subclass's override must run as it
    does under worker processes, so such a dataset goes through ``dataset[i]``)."""
    return isinstance(ds, LMDBImageDataset) and type(ds).__getitem__ is LMDBImageDataset.__getitem__


def _fast_path(loader) -> bool:
    ds = loader.dataset
    transform = getattr(ds, "transform", None)
    return (_own_getitem(ds) and preset_size(transform) is not None and ds.target_transform is None
            and loader._auto_collation and loader.collate_fn in (default_collate, collate_uint8))


def _one_intraop_thread() -> None:
    """Let torch ops in this thread (the resize) run on it alone, as in a DataLoader worker.

    With torch's OpenMP backend every thread that runs a parallel op gets its own OpenMP
    team, so N loader threads would each start another team of intra-op threads on the same
    cores. ``torch.set_num_threads(1)`` cannot be used here: it also sets the process-wide
    default and MKL's global thread count, i.e. the training thread's. ``omp_set_num_threads``
    sets only the calling thread's value; torch's per-thread lazy initialisation (which
    ``get_num_threads`` runs) must happen first or it would overwrite it.
    """
    try:
        torch.get_num_threads()
        ctypes.CDLL(None).omp_set_num_threads(1)
    except (AttributeError, OSError):  # not an OpenMP build, or no libgomp/libomp symbol: nothing to cap
        pass


class _Pool:
    """N daemon threads running ``(fn, args)`` tasks from one queue. Holds no iterator reference.

    ``resize(n)`` (the autotuner's): new threads start at once; surplus ones end after the task
    they are running, so no task is dropped (samples land in their batch slot whichever thread
    runs them: the order of what is handed out does not depend on the pool's size).
    """

    def __init__(self, n: int, stopping: threading.Event) -> None:
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.stopping = stopping
        self.lock = threading.Lock()
        self.retiring = 0  # threads asked to end after their current task
        self.started = 0
        self.threads: list[threading.Thread] = []
        self._start(n)

    def _start(self, n: int) -> None:
        new = [threading.Thread(target=self._work, name=f"fastload-loader-{self.started + k}", daemon=True)
               for k in range(n)]
        self.started += n
        self.threads.extend(new)
        for t in new:
            t.start()

    @property
    def size(self) -> int:
        """Threads that will keep taking tasks (those asked to end not counted)."""
        with self.lock:
            return len(self.threads) - self.retiring

    def resize(self, n: int) -> None:
        with self.lock:
            if self.stopping.is_set():
                return
            now = len(self.threads) - self.retiring
            if n < now:
                self.retiring += now - n
            elif n > now:
                keep = min(self.retiring, n - now)  # cancel pending retirements first
                self.retiring -= keep
                self._start(n - now - keep)

    def _retire(self) -> bool:
        with self.lock:
            if self.retiring == 0:
                return False
            self.retiring -= 1
            self.threads.remove(threading.current_thread())
            return True

    def _work(self) -> None:
        _one_intraop_thread()
        while True:
            if self.retiring and self._retire():
                return
            task = self.tasks.get()
            if task is None:
                return
            fn, args = task
            fn(*args)
            del task, fn, args  # an idle thread must not keep the last batch (and its buffer) alive

    def submit(self, fn: Callable, *args) -> None:
        self.tasks.put((fn, args))

    def close(self, join_s: float = JOIN_TIMEOUT_S) -> None:
        """Stop the threads and wait at most ``join_s`` in all for them (0: do not wait)."""
        self.stop()
        self.join(join_s)

    def stop(self) -> None:
        """Ask every thread to end after its current task (queued tasks return at once)."""
        with self.lock:
            self.stopping.set()
            threads, self.retiring = list(self.threads), 0
        for _ in threads:
            self.tasks.put(None)

    def join(self, join_s: float) -> None:
        deadline = time.monotonic() + join_s
        for t in list(self.threads):
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))


# iterators whose pool is running, for the exit handler below (weakly: an iterator dropped is collected)
_LIVE: weakref.WeakSet = weakref.WeakSet()
_exit_hooked = False


def _hook_exit() -> None:
    """Register ``_close_at_exit`` once, after the first iterator's ``weakref.finalize`` (which registers
    weakref's own exit handler): exit handlers run last-registered first, so this one runs before it."""
    global _exit_hooked
    if not _exit_hooked:
        _exit_hooked = True
        atexit.register(_close_at_exit)


def _close_at_exit() -> None:
    """Stop every live iterator's pool, then wait for their threads within the shared exit budget
    (``exiting.wait_left``; at most ``JOIN_TIMEOUT_S`` for one pool, as ``close()`` waits)."""
    pools = []
    for it in list(_LIVE):
        closer = it._closer
        if closer is not None and closer.detach() is not None:  # not closed yet: it is closed here
            it._pool.stop()
            pools.append(it._pool)
    for pool in pools:  # a thread in the middle of an ordinary sample ends within the floor
        pool.join(exiting.wait_left(JOIN_TIMEOUT_S, floor=EXIT_FLOOR_S))


class _Buffers:
    """Batch buffers: pooled and reused when free (CPU, ``reuse.py``'s rule), or from torch's pinned
    caching allocator."""

    def __init__(self, sample_shape: tuple[int, ...], pin: bool, keep: int,
                 memory_format: torch.memory_format = torch.contiguous_format) -> None:
        self.sample_shape, self.pin, self.keep, self.fmt = sample_shape, pin, keep, memory_format
        self.pool: list[tuple[torch.Tensor, tuple[int, int]]] = []

    def take(self, n: int) -> torch.Tensor:
        """A ``uint8`` tensor of ``n`` samples that nothing else uses (a new view on its storage)."""
        if self.pin:  # freed blocks come back only after their recorded copies completed
            return torch.empty((n, *self.sample_shape), dtype=torch.uint8, pin_memory=True,
                               memory_format=self.fmt)
        if not reuse.trackable():
            return torch.empty((n, *self.sample_shape), dtype=torch.uint8, memory_format=self.fmt)
        self.pool = [(buf, mark) for buf, mark in self.pool if not buf.is_shared()]  # another process's now
        for buf, mark in self.pool:
            if buf.shape[0] >= n and reuse.idle(buf, mark):  # only the pool holds it: nobody sees the refill
                return buf[:n]  # a new tensor on the storage, so holding it shows in the use count
        buf = torch.empty((n, *self.sample_shape), dtype=torch.uint8, memory_format=self.fmt)
        if len(self.pool) < self.keep:
            self.pool.append((buf, reuse.holders(buf)))
        return buf[:n]


class _Batch:
    """One batch being filled: its indices, where samples go, and when it is done."""

    def __init__(self, indices: list[int], images: torch.Tensor | None) -> None:
        self.indices = indices
        self.images = images
        self.labels = [0] * len(indices)
        self.samples: list[Any] = [None] * len(indices)
        self.result: Any = None
        self.error: BaseException | None = None
        self.left = len(indices)
        self.running = [False] * len(indices)  # per sample: a thread is in it now (named on a timeout)
        self.lock = threading.Lock()
        self.done = threading.Event()
        if not indices:
            self.done.set()

    def finish_one(self, finish: Callable[[_Batch], None] | None = None) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            if finish is not None and self.error is None:
                try:
                    finish(self)
                except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
                    self.error = exc
            self.done.set()


class _Job:
    """What the tasks need, without a reference to the iterator (so it can be collected)."""

    def __init__(self, loader, sample_seed: int | None, epoch: int, fast: bool, stopping: threading.Event) -> None:
        self.dataset = loader.dataset
        self.collate_fn = loader.collate_fn
        self.auto_collation = loader._auto_collation
        self.pin = bool(loader.pin_memory) and torch.cuda.is_available()
        self.sample_seed, self.epoch, self.fast, self.stopping = sample_seed, epoch, fast, stopping
        transform = getattr(self.dataset, "transform", None)
        # the generic path seeds too when the dataset can take a generator (what the processes
        # backend does with torch's RNG, which threads share and so cannot seed per sample)
        self.seeded = (sample_seed is not None and is_preset(transform)
                       and accepts_keyword(transform.from_bytes, "generator") and _own_getitem(self.dataset))
        if fast:
            self.shape = (3, self.dataset.transform.size, self.dataset.transform.size)
            self.memory_format = (torch.channels_last if preset_channels_last(self.dataset.transform)
                                  and self.collate_fn is collate_uint8 else torch.contiguous_format)
            # a subclass's own getitem may not take out=
            self.into = preset_writes_into(self.dataset.transform) and accepts_keyword(self.dataset.getitem, "out")
        # plan a few samples, then render them (``_plan``): only where that is exactly what getitem does (a
        # seeded preset that plans, the dataset's own getitem and load, and into the slot as getitem would)
        self.plans = fast and self.seeded and self.into and plans_samples(self.dataset)

    def _generator(self, index: int) -> torch.Generator | None:
        """Sample ``index``'s own generator, freshly seeded (None when the samples are not seeded)."""
        if not self.seeded:
            return None
        return torch.Generator().manual_seed(mix_seed(self.sample_seed, self.epoch, index))

    def run(self, batch: _Batch, positions: list[int]) -> None:
        """One task: these samples of ``batch``, planned back to back first when the preset plans."""
        planned: dict[int, Any] = {}
        if self.plans and len(positions) > 1:
            try:
                planned = self._plan(batch, positions)
            except BaseException as exc:  # noqa: BLE001 - e.g. SystemExit from a read: the batch fails with it
                if batch.error is None:
                    batch.error = exc
        for pos in positions:  # each sample is finished (finish_one) whatever happened above
            self._one(batch, pos, planned.get(pos))

    def _plan(self, batch: _Batch, positions: list[int]) -> dict[int, Any]:
        """Phase one for a run of samples: their record reads and random draws, back to back (many short
        steps that take the GIL), before any is decoded and resized (long steps that release it); two
        threads then overlap one's planning with the other's decoding instead of handing the GIL back and
        forth within every sample. A sample whose read or draw fails is left out: ``_one`` redoes it with
        ``getitem``, which names it and skips or raises as the dataset's ``on_error`` says."""
        planned: dict[int, Any] = {}
        for pos in positions:
            if self.stopping.is_set() or batch.error is not None:
                break
            batch.running[pos] = True  # a read that hangs is named on a timeout
            try:
                planned[pos] = try_plan(self.dataset, batch.indices[pos], self._generator(batch.indices[pos]))
            finally:
                batch.running[pos] = False
        return planned

    def _one(self, batch: _Batch, pos: int, planned: Any = None) -> None:
        try:
            if self.stopping.is_set() or batch.error is not None:
                return
            index = batch.indices[pos]
            batch.running[pos] = True
            if self.fast:
                self._fast(batch, pos, index, planned)
            elif self.seeded:
                batch.samples[pos] = self.dataset.getitem(index, generator=self._generator(index))
            else:
                batch.samples[pos] = self.dataset[index]
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            if batch.error is None:
                batch.error = exc
        finally:
            batch.running[pos] = False
            batch.finish_one(None if self.fast else self._collate)

    def _fast(self, batch: _Batch, pos: int, index: int, planned: Any = None) -> None:
        slot = batch.images[pos]
        # the preset may write the image into its slot (``into``: then there is nothing to copy)
        image, label = item_from_plan(self.dataset, index, planned, lambda: self._generator(index),
                                      out=slot if self.into else None)
        put_in_slot(self.dataset.root, index, image, slot, "the thread pipeline's batch buffer")
        batch.labels[pos] = int(label)

    def _collate(self, batch: _Batch) -> None:
        if self.stopping.is_set():  # closed: nobody will take this batch
            return
        out = self.collate_fn(batch.samples) if self.auto_collation else self.collate_fn(batch.samples[0])
        if self.pin:
            from torch.utils.data._utils.pin_memory import pin_memory

            out = pin_memory(out)
        batch.result = out


class ThreadBatchIterator(Iterator):
    """One epoch of ``loader``'s batches, made by ``loader.num_workers`` threads.

    Made by ``fastload.DataLoader.__iter__`` when ``backend="threads"``; see the module
    docstring for the paths, buffers, determinism, resume and shutdown.

    Args:
        loader: the ``fastload.DataLoader`` (its dataset, sampler, collate, pin_memory,
            prefetch_factor, timeout and generator are used as torch's iterators use them;
            its epoch record is told when the epoch starts, each batch handed out, and the end).
    """

    def __init__(self, loader) -> None:
        self._loader = weakref.ref(loader)  # as torch's iterators: the iterator does not keep its loader alive
        self._len = len(loader)
        self._sampler_iter = iter(loader._index_sampler)  # before the base seed, as torch does
        self._base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item())
        self._tracker = loader._fl_resume  # reports the epoch's events (tracker.py), holds the loader weakly
        self._tracker.epoch_started(self)
        rec = self._tracker.live
        self.epoch, self.sample_seed = rec.epoch, rec.sample_seed
        self.fast = _fast_path(loader)
        self._auto_collation = loader._auto_collation
        self._timeout = loader.timeout
        self._depth = max(1, loader.prefetch_factor or 2)
        n = int(loader.num_workers)
        # the loader's autotuner (autotune.py) sizes the pool and the depth while the epoch runs
        self._tuner = getattr(loader, "autotuner", None) if n > 0 else None
        self._meter = self._tuner.meter if self._tuner is not None else None  # windows run on across epochs
        if self._tuner is not None:
            n, self._depth = self._tuner.threads, self._tuner.depth
            self._meter.epoch_started()
        keep = (self._tuner.options.max_depth if self._tuner is not None else self._depth) + 2
        stopping = threading.Event()
        self._job = _Job(loader, self.sample_seed, self.epoch, self.fast, stopping)
        self._buffers = _Buffers(self._job.shape, self._job.pin, keep=keep,
                                                 memory_format=self._job.memory_format) if self.fast else None
        self._inflight: deque[_Batch] = deque()
        self._exhausted = self._closed = False
        self._pool = _Pool(n, stopping) if n > 0 else None
        # also run at interpreter exit (weakref.finalize's atexit, before CPython stops daemon threads): a
        # daemon thread still inside a torch or decoder call when the interpreter finalises is ended by
        # pthread_exit, whose unwinding through C++ frames aborts the process ("terminate called without an
        # active exception", exit status 134), so a script that ends with an iterator alive must stop the
        # pool first. The threads end after their current sample; a stuck one is waited for at most
        # JOIN_TIMEOUT_S (after a timeout error, not at all: ``_timed_out`` detaches this)
        self._closer = weakref.finalize(self, self._pool.close) if self._pool is not None else None
        if self._pool is not None:  # at exit, every live pool is stopped first, within one shared budget
            _LIVE.add(self)
            _hook_exit()
        try:  # the order is drawn now, not at the first next(): a state taken before it then holds it
            self._fill(self._depth if self._pool is not None else 1)
        except BaseException:
            self.close()
            raise

    @property
    def threads(self) -> list[threading.Thread]:
        """The pool's threads (empty with ``num_workers=0``); under autotune, those still to end included."""
        return list(self._pool.threads) if self._pool is not None else []

    @property
    def pool_size(self) -> int:
        """The threads the pool runs now (what the autotuner last asked for; 0 with ``num_workers=0``)."""
        return self._pool.size if self._pool is not None else 0

    def __iter__(self) -> ThreadBatchIterator:
        return self

    def __len__(self) -> int:
        return self._len

    def _submit_next(self) -> bool:
        try:
            idx = next(self._sampler_iter)
        except StopIteration:
            self._exhausted = True
            return False
        indices = [int(i) for i in idx] if self._auto_collation else [int(idx)]
        images = None
        if self.fast:
            images = self._buffers.take(len(indices))
        batch = _Batch(indices, images)
        self._inflight.append(batch)
        if self._pool is not None:
            for run in self._runs(len(indices)):
                self._pool.submit(self._job.run, batch, run)
        return True

    def _runs(self, n: int) -> list[list[int]]:
        """A batch's positions as tasks: one sample each, or, when the preset plans, runs of up to
        ``PLAN_RUN`` samples, no longer than leaves every thread of the pool a task of the batch."""
        size = max(1, min(PLAN_RUN, n // max(1, self.pool_size))) if self._job.plans else 1
        return [list(range(k, min(k + size, n))) for k in range(0, n, size)]

    def _fill(self, depth: int) -> None:
        while not self._exhausted and len(self._inflight) < depth:
            if not self._submit_next():
                break

    def _end(self) -> StopIteration:
        """The epoch is over: tell the loader (unless closed early), stop the pool."""
        if not self._closed:
            self._tracker.epoch_ended()
        self.close()
        return StopIteration()

    def __next__(self) -> Any:
        if self._pool is None:  # num_workers=0: the same tasks, in the calling thread
            if not self._inflight and not self._submit_next():
                raise self._end()
            batch = self._inflight.popleft()
            for run in self._runs(len(batch.indices)):
                self._job.run(batch, run)
        else:
            if self._meter is not None:
                self._meter.called()
            if not self._inflight:
                self._fill(self._depth)
            if not self._inflight:
                raise self._end()
            batch = self._inflight.popleft()
            self._fill(self._depth)  # keep the threads busy while this one finishes and is used
            if not batch.done.wait(self._timeout if self._timeout > 0 else None):
                raise self._timed_out(batch)
        if batch.error is not None:
            raise batch.error
        out = (batch.images, torch.tensor(batch.labels, dtype=torch.int64)) if self.fast else batch.result
        self._tracker.batch_yielded()  # counted only now: the state describes what the caller received
        if self._meter is not None:
            self._tune()
        return out

    def _tune(self) -> None:
        """At the end of a window: ask the autotuner, then resize the pool and set the depth."""
        window = self._meter.returned(self._tuner.next_window)
        if window is not None and not self._closed:
            decision = self._tuner.observe(window)
            self._pool.resize(decision.threads)
            self._depth = decision.depth

    def _timed_out(self, batch: _Batch) -> RuntimeError:
        """The timeout error (torch's words first), after stopping the pool without waiting for
        the thread that is stuck: the caller gets it within ``timeout`` of asking."""
        pending = [i for i, r in zip(batch.indices, list(batch.running)) if r]
        self._exhausted = self._closed = True
        self._inflight.clear()
        if self._closer is not None and self._closer.alive:
            self._closer.detach()
            self._pool.close(join_s=0.0)
        where = f" (samples still being read: {pending[:8]})" if pending else ""
        return RuntimeError(f"DataLoader timed out after {self._timeout} seconds{where}.\nHINT: a read is "
                            "stuck (a hung network file system?) or slower than timeout; its thread is left "
                            "to finish on its own (a daemon thread: it does not keep the process alive).")

    def close(self) -> None:
        """Stop the pool and join its threads (idempotent); later ``next()`` calls end the epoch.

        A loader state taken after ``close()`` mid-epoch still resumes at the next batch not
        handed out (the epoch is not counted as finished).
        """
        self._exhausted = self._closed = True
        self._inflight.clear()
        if self._closer is not None:
            self._closer()
