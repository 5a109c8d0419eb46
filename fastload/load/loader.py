"""``fastload.DataLoader``: torch's DataLoader with the defaults a GPU job wants.

Owns: the drop-in subclass. Every argument, default and behaviour of
``torch.utils.data.DataLoader`` holds (PyTorch's own DataLoader tests pass against it,
``tools/run_torch_dataloader_tests.py``), except where the user asked for more:

* ``num_workers="auto"`` (and only then) picks ``auto_num_workers()``; integers are used
  as given.
* ``pin_memory`` defaults to ``torch.cuda.is_available()`` instead of False.
* Under an initialised ``torch.distributed`` process group, a map-style dataset with
  neither ``sampler`` nor ``batch_sampler`` gets a ``DistributedSampler`` (``shuffle``
  and ``drop_last`` map onto it; seed from ``generator`` if given, else 0), and
  ``set_epoch`` is called at the start of every epoch so each epoch reshuffles.
* ``main_threads="auto"``: when workers start, the main process's intra-op threads are
  capped at ``max(1, cpus_per_process - num_workers)`` so main + workers do not
  oversubscribe the CPUs (``workers.py``). ``None`` leaves them alone; an int sets them.
  The previous count is restored when the epoch ends or the workers shut down.
* ``state_dict()`` / ``load_state_dict(sd)`` and ``snapshot_every_n_steps``: torchdata
  ``StatefulDataLoader``'s API, built on torch's own iterators (``_resume_iter.py``) so every
  batch is still made by torch's code; exact mid-epoch resume and elastic resume across world
  sizes (``state.py``), stateful iterable datasets resumed as torchdata does. Every iterator
  (both backends) reports to one ``ResumeTracker`` (``tracker.py``) and the state is one typed
  schema (``state.LoaderState``, checked field by field at load): one saved with
  ``backend="processes"`` resumes with ``"threads"`` and back.
* With a fastload preset transform (``train_transform()``), each sample's augmentation
  draws from an RNG seeded by ``(seed, epoch, index)`` (torch's, restored after, in
  processes; a generator of its own in threads), so it does not depend on which worker,
  thread or rank loads the sample, on the backend, or on whether the run was resumed.

* ``backend="processes"`` (default) is torch's worker processes. ``backend="threads"``
  makes the batches with ``num_workers`` threads of this process instead (``threads.py``:
  no worker processes, no ``/dev/shm``, reused batch buffers, per-sample seeds).
  With ``num_workers="auto"`` (or ``autotune=True``) the thread count and prefetch depth are
  then sized while it trains (``autotune.py``): ``auto_num_workers()`` is only the start.
* With worker processes and ``collate_fn=collate_uint8``, each worker reuses its batches'
  shared memory once the main process has let go of a batch (``batch_pool.py``; the same
  batches; ``reuse_batch_memory=False``: a fresh segment per batch, as torch does).
* Before worker processes start, ``/dev/shm`` is checked against ``num_workers ×
  prefetch_factor ×`` the batch size in bytes (from the preset's output size, else from one
  sample collated, for fastload's and torchvision's folder datasets only: an arbitrary
  ``__getitem__`` is not run in the parent); when it cannot hold them, ``SharedMemoryError`` says how to fix it
  instead of the workers dying with "Bus error" (``workers.py`` says why switching torch's
  sharing strategy would not help).

Must not: change what a batch contains (that is the dataset's and collate's business).
"""

from __future__ import annotations

import logging
import time
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.utils.data
from torch.utils.data import DistributedSampler, IterableDataset

from fastload.load import _resume_iter as _ri
from fastload.load.tracker import ResumeTracker
from fastload.load.dataset import LMDBImageDataset, reads_by_shard
from fastload.load.batch_pool import PooledCollate, pool_fits, release_is_tracked, slots_for
from fastload.load.transforms import collate_uint8, preset_size
from fastload.load.workers import auto_num_workers, check_shm, main_thread_budget

BACKENDS = ("processes", "threads")
log = logging.getLogger("fastload")

__all__ = ["DataLoader"]

T_co = TypeVar("T_co", covariant=True)


class DataLoader(torch.utils.data.DataLoader[T_co]):
    """A drop-in ``torch.utils.data.DataLoader``; see the module docstring for what differs.

    Extra keyword-only arguments:
        main_threads: ``"auto"`` (default), ``None`` or an int; see the module docstring.
        backend: ``"processes"`` (default) or ``"threads"``; see the module docstring.
        autotune: None (default: on for ``backend="threads"`` with ``num_workers="auto"``), True,
            False, an ``AutotuneOptions`` or an ``AutoTuner``: size the thread pool and prefetch
            depth while training (``autotune.py``); ``autotune_decisions`` lists what it did.
        snapshot_every_n_steps: torchdata ``StatefulDataLoader``'s: how often workers send
            an iterable dataset's state (1, default: with every batch; n: around every n-th
            step, and a state taken in between reads the batches since again on resume;
            0 or None: never, so a resume reads the epoch again up to where it stopped).
        reuse_batch_memory: True (default): with worker processes and ``collate_fn=collate_uint8``,
            each worker writes its batches into shared-memory segments it reuses once the main
            process has let go of the batch (``batch_pool.py``): the same batches, without the
            kernel zeroing a fresh segment for each (only where ``/dev/shm`` has room for every
            worker's ``prefetch_factor + 2`` segments at once). False: a fresh segment per batch, as
            torch does; pass it when you hand the loader's batches to another process yourself
            (a ``multiprocessing`` queue or pipe, or a fork).

    Raises:
        SharedMemoryError: (when iterated) ``/dev/shm`` is too small for the workers' batches.
    """

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None,
                 num_workers=0, collate_fn=None, pin_memory=None, drop_last=False, timeout=0,
                 worker_init_fn=None, multiprocessing_context=None, generator=None, *,
                 prefetch_factor=None, persistent_workers=False, pin_memory_device="", in_order=True,
                 main_threads="auto", backend="processes", snapshot_every_n_steps=1, autotune=None,
                 reuse_batch_memory=True):
        if backend not in BACKENDS:
            raise ValueError(f"Unknown value {backend!r} for argument backend. "
                             "Valid values are 'processes', 'threads'.")
        tuner = _autotuner(autotune, backend, num_workers, prefetch_factor)
        if tuner is not None:
            num_workers = tuner.threads
        if isinstance(num_workers, str):
            if num_workers != "auto":
                raise ValueError(f"Unknown value {num_workers!r} for argument num_workers. "
                                 "Valid values are 'auto' or an integer >= 0.")
            num_workers = auto_num_workers()
        if not (main_threads is None or main_threads == "auto" or (isinstance(main_threads, int)
                                                                   and main_threads >= 1)):
            raise ValueError(f"Unknown value {main_threads!r} for argument main_threads. "
                             "Valid values are 'auto', None or an integer >= 1.")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.backend = backend  # before torch's __init__, which calls check_worker_number_rationality
        auto_sampler = False
        if sampler is None and batch_sampler is None and reads_by_shard(dataset):
            # a store in object storage is read shard by shard (load/shards.py), with or without
            # torch.distributed: a random order over all samples would download every shard at once
            from fastload.load.shards import ShardSampler

            seed = generator.initial_seed() if generator is not None else 0
            sampler = ShardSampler(dataset, shuffle=bool(shuffle), seed=seed, drop_last=drop_last)
            shuffle, auto_sampler = None, True
        elif (sampler is None and batch_sampler is None and not isinstance(dataset, IterableDataset)
                and dist.is_available() and dist.is_initialized()):
            seed = generator.initial_seed() if generator is not None else 0
            sampler = DistributedSampler(dataset, shuffle=bool(shuffle), seed=seed, drop_last=drop_last)
            shuffle, auto_sampler = None, True
        super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
                         pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
                         prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                         pin_memory_device=pin_memory_device, in_order=in_order)
        self.main_threads = main_threads
        self.reuse_batch_memory = bool(reuse_batch_memory)
        self._auto_sampler = auto_sampler
        self._epoch = 0
        if snapshot_every_n_steps is not None and (isinstance(snapshot_every_n_steps, bool) or not isinstance(
                snapshot_every_n_steps, int) or snapshot_every_n_steps < 0):
            raise ValueError(f"Unknown value {snapshot_every_n_steps!r} for argument snapshot_every_n_steps. "
                             "Valid values are None or an integer >= 0 (0 or None: only at the epoch's start).")
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self._fl_resume = ResumeTracker(self, snapshot_every_n_steps or 0)
        self._batch_bytes: int | None = None
        self.autotuner = tuner
        if backend == "threads":
            from fastload.load.threads import check_thread_backend

            check_thread_backend(self)

    def check_worker_number_rationality(self) -> None:
        """torch's "too many worker processes" warning, which threads (no processes) do not get."""
        if self.backend != "threads":
            super().check_worker_number_rationality()

    @property
    def autotune_decisions(self) -> list[dict] | None:
        """The autotuner's decisions so far (``autotune.Decision.as_dict()``), None without one."""
        return None if self.autotuner is None else [d.as_dict() for d in self.autotuner.decisions]

    @property
    def epoch(self) -> int:
        """Epochs started so far (what the automatic ``set_epoch`` received last, plus one)."""
        return self._epoch

    time_to_first_batch: float | None = None  #: seconds from ``iter()`` to the first batch of the latest epoch

    def first_batch_arrived(self, epoch: int) -> None:
        """The tracker's call at an epoch's first batch: record the time since ``iter()`` on the loader and on
        the dataset (``time_to_first_batch``); for a store in object storage, log it (INFO, ``fastload``)."""
        t0 = self.__dict__.get("_fl_iter_t0")
        if t0 is None:
            return
        seconds = self.__dict__["time_to_first_batch"] = time.perf_counter() - t0
        self.__dict__["_fl_iter_t0"] = None
        if reads_by_shard(self.dataset):
            try:
                self.dataset.time_to_first_batch = seconds
            except AttributeError:
                pass
            log.info("fastload: first batch of epoch %d from %s after %.2f s (num_workers=%d)", epoch,
                     getattr(self.dataset, "root", "?"), seconds, self.num_workers)

    def __iter__(self):
        self.__dict__["_fl_iter_t0"] = time.perf_counter()
        if self._auto_sampler:
            self.sampler.set_epoch(self._epoch)
        self._epoch += 1
        if self.backend == "threads":  # each loader thread runs one intra-op thread (threads.py)
            return self._resume_iter()
        if self.num_workers > 0 and getattr(self, "_iterator", None) is None:
            self._check_shm()
        before = None
        if self.num_workers > 0 and self.main_threads is not None:
            target = main_thread_budget(self.num_workers) if self.main_threads == "auto" else self.main_threads
            if self.main_threads != "auto" or torch.get_num_threads() > target:
                before = torch.get_num_threads()
                torch.set_num_threads(target)
        try:
            it = self._resume_iter()
        except BaseException:
            if before is not None:
                torch.set_num_threads(before)
            raise
        if before is not None and isinstance(it, _ri.MultiIter):  # given back when the epoch ends
            it.restore_threads_to(before)
        return it

    # ---- mid-epoch resume: tracker.py keeps the record, state.py has the format and the rules ----

    @property
    def _index_sampler(self):
        # super(), not torch.utils.data.DataLoader: code that installs fastload's class as
        # torch.utils.data.DataLoader (a drop-in) would make that name this property itself
        inner = super()._index_sampler
        tracker = getattr(self, "_fl_resume", None)
        if tracker is None or tracker.iterable:
            return inner
        if tracker.index is None or tracker.index.inner is not inner:
            tracker.index = _ri.ResumableIndex(inner)
        return tracker.index

    def _get_iterator(self):
        if self.num_workers == 0:
            return _ri.SingleIter(self)
        self.check_worker_number_rationality()
        tracker = self._fl_resume
        saved = tracker.plan.workers if tracker.plan is not None else None
        user_init, user_collate = self.worker_init_fn, self.collate_fn
        slots = slots_for(self.prefetch_factor)
        pooled = (self.reuse_batch_memory and user_collate is collate_uint8 and release_is_tracked()
                  and pool_fits(self.num_workers, slots, self._batch_bytes))
        if saved is not None or tracker.seeding or tracker.iterable or tracker.map_stateful or user_init is not None:
            # code runs at a worker's start that may raise (the user's worker_init_fn, a saved state
            # the dataset refuses): iter() waits for every worker to have run it and raises its error
            acks = None
            if user_init is not None or saved is not None:
                acks = (self.multiprocessing_context or torch.multiprocessing).Queue()
            self.worker_init_fn = _ri.WorkerInit(user_init, saved, tracker.seeding,
                                                 tracker.iterable or tracker.map_stateful, acks=acks,
                                                 persistent=self.persistent_workers, collate_writes=pooled)
        if pooled:
            # each worker reuses its batches' shared memory once this process let go of them, and a preset that
            # plans writes its images straight into it (batch_pool.py)
            self.collate_fn = PooledCollate(self.num_workers, slots)
        try:  # torch's iterator reads them when it is built; the loader keeps the user's
            return _ri.MultiIter(self)
        finally:
            self.worker_init_fn = user_init
            self.collate_fn = user_collate

    def _new_iterator(self):
        """torch's iterator for this epoch (``_get_iterator`` above), or the thread pipeline's."""
        if self.backend == "threads":
            from fastload.load.threads import ThreadBatchIterator

            return ThreadBatchIterator(self)
        return super().__iter__()

    def _resume_iter(self):
        return self._fl_resume.iterator(self, self._new_iterator)

    def state_dict(self) -> dict:
        """The loader's position, to resume from with ``load_state_dict`` (torchdata's API).

        Take it between batches. A loader built the same way and given it yields exactly
        the batches this one would have yielded next (``state.py`` has the rules; elastic
        across world sizes under ``DistributedSampler``). The state holds no sample data:
        a few ints, RNG states (~6.7 KB each, base64 text), and your sampler's / dataset's own states.
        Cost: O(1) for map-style datasets; an iterable dataset's ``state_dict()`` per call
        (with workers: per batch, or around every ``snapshot_every_n_steps``-th one).
        Either backend: it counts the batches you received, not those being made ahead.
        """
        return self._fl_resume.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume from ``state_dict()``'s result: the next ``iter()`` continues from there.

        The whole state is checked first (``state.LoaderState.from_dict``: every field's type,
        size and range, and how they fit together), so a damaged or hand-edited state fails
        here, naming the field, and not later with a raw error or silently wrong samples.

        Raises:
            ResumeStateError: the state is corrupt (the message names the field), or was saved
                for another dataset (kind, length, store identity), seed, kind of sampler, batch
                size (for a non-distributed epoch) or ``num_workers`` (iterable datasets); the
                message names what differs.
        """
        self._fl_resume.load(self, state_dict)
        self._epoch = self._fl_resume.plan.epoch

    def _check_shm(self) -> None:
        """Raise ``SharedMemoryError`` before workers start when /dev/shm cannot hold their batches."""
        if self._batch_bytes is None:
            self._batch_bytes = _estimate_batch_bytes(self)
        if self._batch_bytes:
            check_shm(self.num_workers, self.prefetch_factor or 2, self._batch_bytes)


def _autotuner(autotune, backend: str, num_workers, prefetch_factor):
    """The loader's ``AutoTuner`` (``autotune.py``), or None: on by default for threads with
    ``num_workers="auto"``; ``True``, ``AutotuneOptions`` or an ``AutoTuner`` turn it on."""
    from fastload.load.autotune import AutoTuner, AutotuneOptions

    if autotune is None:
        autotune = backend == "threads" and num_workers == "auto"
    if autotune is False:
        return None
    if not isinstance(autotune, (bool, AutotuneOptions, AutoTuner)):
        raise ValueError(f"Unknown value {autotune!r} for argument autotune. Valid values are None, True, False, "
                         "an AutotuneOptions or an AutoTuner.")
    if backend != "threads":
        raise ValueError("autotune sizes the thread pool of backend='threads'; got backend="
                         f"{backend!r}.\nHINT: DataLoader(..., backend='threads', num_workers='auto').")
    if isinstance(autotune, AutoTuner):
        return autotune
    from fastload.system import available_cpus

    start = auto_num_workers() if num_workers == "auto" else num_workers
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise ValueError(f"Unknown value {num_workers!r} for argument num_workers. "
                         "Valid values are 'auto' or an integer >= 0.")
    options = autotune if isinstance(autotune, AutotuneOptions) else AutotuneOptions()
    return AutoTuner(threads=start, depth=prefetch_factor or 2, cpus=available_cpus(), options=options)


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _safe_to_sample_here(ds) -> bool:
    """Datasets whose ``ds[0]`` may run in the main process before workers fork.

    Ours (its LMDB handles are reopened after fork) and torchvision's folder datasets
    (file reads and Pillow). Anything else is not touched: an arbitrary ``__getitem__`` in
    the parent can initialise CUDA (forked workers then fail) or open an LMDB environment
    that forked workers would inherit.
    """
    if isinstance(ds, LMDBImageDataset):
        return True
    try:
        from torchvision.datasets import DatasetFolder
    except ImportError:
        return False
    return isinstance(ds, DatasetFolder)


def _estimate_batch_bytes(loader: DataLoader) -> int:
    """Bytes of tensors in one batch (what workers put in /dev/shm); 0 when it is not known.

    A fastload preset says its output size; for datasets safe to read here
    (``_safe_to_sample_here``) one sample is loaded and collated (a failure there is left
    to the workers to report, with their context); other datasets are not checked.
    """
    ds, bs = loader.dataset, loader.batch_size or 1
    size = preset_size(getattr(ds, "transform", None))
    if size is not None:
        return bs * (3 * size * size + 8)
    if isinstance(ds, IterableDataset) or not _safe_to_sample_here(ds):
        return 0
    try:
        sample = ds[0]
        one = loader.collate_fn([sample]) if loader._auto_collation else loader.collate_fn(sample)
    except Exception:
        return 0
    return bs * _tensor_bytes(one)
