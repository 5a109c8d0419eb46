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
* ``state_dict()`` / ``load_state_dict(sd)``: torchdata ``StatefulDataLoader``'s API, built
  on torch's own iterators (``_resume_iter.py``) so every batch is still made by torch's
  code; exact mid-epoch resume and elastic resume across world sizes (``state.py``). Both
  backends keep the same record (the thread pipeline reports to the same hooks) and write
  the same state: one saved with ``backend="processes"`` resumes with ``"threads"`` and back.
* With a fastload preset transform (``train_transform()``), each sample's augmentation
  draws from an RNG seeded by ``(seed, epoch, index)`` (torch's, restored after, in
  processes; a generator of its own in threads), so it does not depend on which worker,
  thread or rank loads the sample, on the backend, or on whether the run was resumed.

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

from fastload.errors import ResumeStateError
from fastload.load import _resume_iter as _ri
from fastload.load import state as _state
from fastload.load.dataset import LMDBImageDataset
from fastload.load.transforms import preset_size
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
        self._resume_setup()
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

    # ---- mid-epoch resume (state.py has the format and the rules) ---------------------------

    def _resume_setup(self) -> None:
        self._resume_plan: dict | None = None
        self._resume_live: _ri.EpochRecord | None = None
        self._resume_index: _ri.ResumableIndex | None = None
        self._resume_ident: tuple[str | None] | None = None
        self._resume_iterable = isinstance(self.dataset, IterableDataset)
        self._resume_seeding = (not self._resume_iterable and self.batch_sampler is not None
                                and _state.uses_fastload_preset(self.dataset))

    @property
    def _index_sampler(self):
        # super(), not torch.utils.data.DataLoader: code that installs fastload's class as
        # torch.utils.data.DataLoader (a drop-in) would make that name this property itself
        inner = super()._index_sampler
        if getattr(self, "_resume_iterable", True):
            return inner
        if self._resume_index is None or self._resume_index.inner is not inner:
            self._resume_index = _ri.ResumableIndex(inner)
        return self._resume_index

    def _get_iterator(self):
        if self.num_workers == 0:
            return _ri.SingleIter(self)
        self.check_worker_number_rationality()
        plan = self._resume_plan
        states = plan["workers"]["states"] if plan is not None and plan["workers"] is not None else None
        user_init, user_collate = self.worker_init_fn, self.collate_fn
        if states is not None or self._resume_seeding:
            self.worker_init_fn = _ri.WorkerInit(user_init, states, self._resume_seeding)
        if self._resume_iterable and _ri.is_stateful(self.dataset):
            self.collate_fn = _ri.StateCollate(user_collate)
        try:  # torch's iterator reads both when it is built; the loader keeps the user's
            return _ri.MultiIter(self)
        finally:
            self.worker_init_fn, self.collate_fn = user_init, user_collate

    def _new_iterator(self):
        """torch's iterator for this epoch (``_get_iterator`` below), or the thread pipeline's."""
        if self.backend == "threads":
            from fastload.load.threads import ThreadBatchIterator

            return ThreadBatchIterator(self)
        return super().__iter__()

    def _resume_iter(self):
        plan = self._resume_plan
        if plan is None:
            return self._new_iterator()
        if plan["order"] is None and not plan["batches"] and plan["workers"] is None:
            # saved between epochs: this epoch starts as any epoch does, from the RNG as it is now
            if self._resume_iterable and plan["dataset_state"] is not None:
                self.dataset.load_state_dict(plan["dataset_state"])
            return self._new_iterator()
        if self._resume_iterable and self.num_workers == 0 and plan["dataset_state"] is not None:
            self.dataset.load_state_dict(plan["dataset_state"])
        gens = self._resume_generators()
        if plan["order"] is not None and plan["order"]["kind"] == "replay":
            # the replay puts the loader's generator where the saved epoch's order left it
            # (ResumableIndex._replay), not the saved "generator", which depends on how far the
            # saving run's workers or threads had read ahead; only torch's global RNG is kept
            gens = {"global": gens["global"]}
        now = _state.rng_snapshot(gens)
        try:  # building the resumed iterator must not consume the user's random draws
            it = self._new_iterator()
            if self._resume_iterable and not _ri.is_stateful(self.dataset) and plan["batches"]:
                for _ in range(plan["batches"]):  # no state to load: fast-forward by reading
                    next(it)
                self._resume_live.batches = 0
        finally:
            _state.rng_restore(gens, now)
        return it

    def _resume_generators(self) -> dict[str, torch.Generator]:
        gens = {"global": torch.default_generator}
        if isinstance(self.generator, torch.Generator):
            gens["loader"] = self.generator
        return gens

    def _resume_distributed(self) -> DistributedSampler | None:
        for s in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
            if isinstance(s, DistributedSampler):
                return s
        return None

    def _resume_epoch_started(self, it) -> int:
        plan, self._resume_plan = self._resume_plan, None
        seed = None
        dist_sampler = self._resume_distributed()
        if self._resume_seeding:
            if plan is not None and plan["sample_seed"] is not None:
                seed = plan["sample_seed"]
            elif dist_sampler is not None:  # the same on every rank, whatever the world size
                seed = _state.mix_seed(dist_sampler.seed, 0x5EED)
            else:
                seed = int(it._base_seed)
        epoch = dist_sampler.epoch if dist_sampler is not None else self._epoch - 1  # the user may set_epoch
        rec = _ri.EpochRecord(epoch, plan, seed, self.generator)
        rotate = 0
        if self._resume_iterable and self.num_workers > 0:
            saved = plan["workers"] if plan is not None else None
            rec.worker_states = list(saved["states"]) if saved else [None] * self.num_workers
            rec.next_worker = rotate = saved["next"] if saved else 0
        self._resume_live = rec
        if not self._resume_iterable:
            self._index_sampler.live = rec  # read at the epoch's first index, maybe after the loader is gone
        return rotate

    def _resume_batch_yielded(self, it) -> None:
        if self._resume_live is not None:
            self._resume_live.batches += 1

    def _resume_worker_state(self, worker_id: int, state) -> None:
        rec = self._resume_live
        if rec is not None and rec.worker_states is not None:
            rec.worker_states[worker_id] = state
            rec.next_worker = (worker_id + 1) % self.num_workers

    def _resume_epoch_ended(self, it) -> None:
        if self._resume_live is not None:
            self._resume_live.finished = True

    def _resume_facts(self) -> dict:
        if self._resume_ident is None:
            self._resume_ident = (_state.dataset_identity(self.dataset),)
        dist_sampler = self._resume_distributed()
        if dist_sampler is not None:
            seed = dist_sampler.seed
        else:
            seed = self.generator.initial_seed() if isinstance(self.generator, torch.Generator) else None
        try:
            length = len(self.dataset)
        except TypeError:
            length = None
        return {"kind": "iterable" if self._resume_iterable else "map", "length": length,
                "identity": self._resume_ident[0], "seed": seed, "distributed": dist_sampler is not None}

    def state_dict(self) -> dict:
        """The loader's position, to resume from with ``load_state_dict`` (torchdata's API).

        Take it between batches. A loader built the same way and given it yields exactly
        the batches this one would have yielded next (``state.py`` has the rules; elastic
        across world sizes under ``DistributedSampler``). The state holds no sample data:
        a few ints, RNG states (~5 KB each), and your sampler's / dataset's own states.
        Cost: O(1) for map-style datasets; an iterable dataset's ``state_dict()`` per call.
        Either backend: it counts the batches you received, not those being made ahead.
        """
        if self._resume_plan is not None:  # loaded and not started yet: the same position
            return dict(self._resume_plan)
        facts = self._resume_facts()
        rec = self._resume_live
        sd = {"format": _state.STATE_FORMAT, "version": _state.STATE_VERSION,
              "dataset": {"kind": facts["kind"], "len": facts["length"], "identity": facts["identity"]},
              "batch_size": self.batch_size, "seed": facts["seed"],
              "generator": bytes(self.generator.get_state().numpy().tobytes())
              if isinstance(self.generator, torch.Generator) else None,
              "epoch": rec.epoch + 1 if rec is not None else self._epoch, "batches": 0, "order": None,
              "sample_seed": None, "dataset_state": None, "workers": None}
        stateful = self._resume_iterable and _ri.is_stateful(self.dataset)
        if rec is not None and not rec.finished:
            done = rec.plan["batches"] if rec.plan is not None else 0
            sd.update(epoch=rec.epoch, batches=done + rec.batches, sample_seed=rec.sample_seed)
            order = rec.order
            if order is None and not self._resume_iterable:  # iter() was called, next() not yet
                order = self._index_sampler.pending_order(rec)
            order = dict(order) if order is not None else None
            if order is not None and order["kind"] == "distributed" and rec.batches:
                per = self.batch_size if self.batch_sampler is not None else 1
                order["consumed"] += order["world"] * min(rec.batches * per, rec.rank_len)
            sd["order"] = order
            if rec.worker_states is not None:
                sd["workers"] = {"num_workers": self.num_workers, "states": list(rec.worker_states),
                                 "next": rec.next_worker}
        if stateful and self.num_workers == 0:
            sd["dataset_state"] = self.dataset.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume from ``state_dict()``'s result: the next ``iter()`` continues from there.

        Raises:
            ResumeStateError: the state is corrupt, or was saved for another dataset
                (kind, length, store identity), seed, kind of sampler, batch size (for a
                non-distributed epoch) or ``num_workers`` (iterable datasets); the message
                names what differs.
        """
        facts = self._resume_facts()
        sd = _state.check_state(state_dict, kind=facts["kind"], length=facts["length"],
                                identity=facts["identity"], seed=facts["seed"], batch_size=self.batch_size,
                                distributed=facts["distributed"],
                                num_workers=self.num_workers)
        if self._resume_iterable:
            if sd["dataset_state"] is not None and self.num_workers > 0:
                raise _state.mismatch_error("num_workers", 0, self.num_workers, "the state holds one dataset state "
                                  "(saved with num_workers=0): resume with num_workers=0.")
            if self._iterator is not None:
                raise ResumeStateError("load_state_dict on a loader whose persistent workers already run: "
                                       "their dataset copies cannot take the state.\nHINT: call "
                                       "load_state_dict before the first iter() of a new loader.")
        if sd["generator"] is not None and isinstance(self.generator, torch.Generator):
            self.generator.set_state(torch.frombuffer(bytearray(sd["generator"]), dtype=torch.uint8))
        self._epoch = sd["epoch"]
        self._resume_live = None
        self._resume_plan = sd

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
