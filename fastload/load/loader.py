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
* ``backend="processes"`` (default) is torch's worker processes. ``backend="threads"``
  makes the batches with ``num_workers`` threads of this process instead (``threads.py``:
  no worker processes, no ``/dev/shm``, reused batch buffers, per-sample seeds).
* Before worker processes start, ``/dev/shm`` is checked against ``num_workers ×
  prefetch_factor ×`` the batch size in bytes (from the preset's output size, else from one
  sample collated, for fastload's and torchvision's folder datasets only: an arbitrary
  ``__getitem__`` is not run in the parent); when it cannot hold them, ``SharedMemoryError`` says how to fix it
  instead of the workers dying with "Bus error" (``workers.py`` says why switching torch's
  sharing strategy would not help).

Must not: change what a batch contains (that is the dataset's and collate's business).
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist
import torch.utils.data
from torch.utils.data import DistributedSampler, IterableDataset

from fastload.load.dataset import LMDBImageDataset
from fastload.load.workers import auto_num_workers, check_shm, main_thread_budget

BACKENDS = ("processes", "threads")

__all__ = ["DataLoader"]

T_co = TypeVar("T_co", covariant=True)


class DataLoader(torch.utils.data.DataLoader[T_co]):
    """A drop-in ``torch.utils.data.DataLoader``; see the module docstring for what differs.

    Extra keyword-only arguments:
        main_threads: ``"auto"`` (default), ``None`` or an int; see the module docstring.
        backend: ``"processes"`` (default) or ``"threads"``; see the module docstring.

    Raises:
        SharedMemoryError: (when iterated) ``/dev/shm`` is too small for the workers' batches.
    """

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None,
                 num_workers=0, collate_fn=None, pin_memory=None, drop_last=False, timeout=0,
                 worker_init_fn=None, multiprocessing_context=None, generator=None, *,
                 prefetch_factor=None, persistent_workers=False, pin_memory_device="", in_order=True,
                 main_threads="auto", backend="processes"):
        if backend not in BACKENDS:
            raise ValueError(f"Unknown value {backend!r} for argument backend. "
                             "Valid values are 'processes', 'threads'.")
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
        if (sampler is None and batch_sampler is None and not isinstance(dataset, IterableDataset)
                and dist.is_available() and dist.is_initialized()):
            seed = generator.initial_seed() if generator is not None else 0
            sampler = DistributedSampler(dataset, shuffle=bool(shuffle), seed=seed, drop_last=drop_last)
            shuffle, auto_sampler = None, True
        super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
                         pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
                         prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                         pin_memory_device=pin_memory_device, in_order=in_order)
        self.main_threads = main_threads
        self._auto_sampler = auto_sampler
        self._epoch = 0
        self._batch_bytes: int | None = None
        if backend == "threads":
            from fastload.load.threads import check_thread_backend

            check_thread_backend(self)

    def check_worker_number_rationality(self) -> None:
        """torch's "too many worker processes" warning, which threads (no processes) do not get."""
        if self.backend != "threads":
            super().check_worker_number_rationality()

    @property
    def epoch(self) -> int:
        """Epochs started so far (what the automatic ``set_epoch`` received last, plus one)."""
        return self._epoch

    def __iter__(self):
        if self._auto_sampler:
            self.sampler.set_epoch(self._epoch)
        self._epoch += 1
        if self.num_workers > 0 and self.main_threads is not None:
            target = main_thread_budget(self.num_workers) if self.main_threads == "auto" else self.main_threads
            if self.main_threads != "auto" or torch.get_num_threads() > target:
                torch.set_num_threads(target)
        if self.backend == "threads":
            from fastload.load.threads import ThreadBatchIterator

            return ThreadBatchIterator(self, epoch=self._epoch - 1)
        if self.num_workers > 0 and getattr(self, "_iterator", None) is None:
            self._check_shm()
        return super().__iter__()

    def _check_shm(self) -> None:
        """Raise ``SharedMemoryError`` before workers start when /dev/shm cannot hold their batches."""
        if self._batch_bytes is None:
            self._batch_bytes = _estimate_batch_bytes(self)
        if self._batch_bytes:
            check_shm(self.num_workers, self.prefetch_factor or 2, self._batch_bytes)


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
    size = getattr(getattr(ds, "transform", None), "size", None)
    if callable(getattr(getattr(ds, "transform", None), "from_bytes", None)) and isinstance(size, int):
        return bs * (3 * size * size + 8)
    if isinstance(ds, IterableDataset) or not _safe_to_sample_here(ds):
        return 0
    try:
        sample = ds[0]
        one = loader.collate_fn([sample]) if loader._auto_collation else loader.collate_fn(sample)
    except Exception:
        return 0
    return bs * _tensor_bytes(one)
