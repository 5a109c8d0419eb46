"""The resume seam: one tracker per loader that the iterators report to.

Owns: ``ResumeTracker`` (what ``fastload.DataLoader.state_dict()`` / ``load_state_dict()``
do), ``DALITracker`` (the same for ``fastload.DALILoader``), ``EpochRecord`` (the epoch an
iterator is in, for both) and ``advance`` (the elastic rule's count of a segment read so far,
for both). Every iterator, torch's two (``_resume_iter.py``), the thread pipeline
(``threads.py``) and the DALI loader's epoch (``dali.py``), reports the same events and
nothing else: ``epoch_started(...)``, ``batch_yielded()``, ``worker_state(...)`` (workers
with dataset states only) and ``epoch_ended()``. A tracker holds a loaded state as ``plan``
until the next epoch starts, and the live epoch as ``live``; the states they build are the
typed ``LoaderState`` and ``DALIState`` of ``state.py``, which also validates a loaded one.

``ResumeTracker`` holds its loader by a weak reference (iterators hold the tracker, and torch's
iterators must not keep their loader alive: ``_resume_iter.py`` says why); ``DALITracker`` holds
none, its loader hands itself to each call that needs it.

Must not: make batches, or import torch's private iterator classes (``_resume_iter.py`` does).
"""

from __future__ import annotations

import inspect
import logging

import dataclasses
import weakref

import torch
from torch.utils.data import DistributedSampler, IterableDataset

from fastload.errors import ResumeStateError
from fastload.load import replay as _replay
from fastload.load import state as _state
from fastload.load.state import (DALIGlobalOrder, DALIShardOrder, DALIState, DistributedOrder, FetcherState,
                                 LoaderState, ReplayOrder, WorkerStates)

__all__ = ["ResumeTracker", "DALITracker", "EpochRecord", "advance", "is_stateful", "settle_ended"]

log = logging.getLogger("fastload")


def is_stateful(obj) -> bool:
    """torchdata's ``Stateful``: ``state_dict()`` callable with no argument, ``load_state_dict(state)``.

    The signatures are checked, not only the names: other libraries' datasets have methods of
    those names with other meanings (MosaicML Streaming's ``state_dict(num_samples,
    from_beginning)``), and treating them as torchdata's would crash a loader that torch's own
    iterates fine.
    """
    sd, lsd = getattr(obj, "state_dict", None), getattr(obj, "load_state_dict", None)
    if not (callable(sd) and callable(lsd)):
        return False
    try:
        sd_params = inspect.signature(sd).parameters.values()
        lsd_params = list(inspect.signature(lsd).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): take the names' word
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    no_arg = all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sd_params)
    one_arg = any(p.kind in positional or p.kind is p.VAR_POSITIONAL for p in lsd_params)
    required = [p for p in lsd_params if p.kind in positional and p.default is p.empty]
    return no_arg and one_arg and len(required) <= 1


def settle_ended(fetcher, dataset, dataset_state, iter_state) -> None:
    """Resume an iterable dataset whose state was taken after its last sample: nothing more is
    read this epoch (torchdata's ``fetcher_ended``), and the dataset is left as it was then.

    Whether the loaded state already says "nothing left" depends on the dataset: one whose
    ``load_state_dict`` sets a start that its next ``iter()`` consumes must run that iterator
    once (or its next epoch starts at the end); one that resets itself when exhausted (the
    torchdata tutorial's) would start over. So the iterator is asked once: if it had more, the
    state is loaded again into a fresh iterator (one sample read and dropped, at resume only).
    """
    try:
        next(fetcher.dataset_iter)
    except StopIteration:
        pass
    else:
        if dataset_state is not None:
            dataset.load_state_dict(dataset_state)
        fetcher.dataset_iter = iter(dataset)
        if iter_state is not None and is_stateful(fetcher.dataset_iter):
            fetcher.dataset_iter.load_state_dict(iter_state)
    fetcher.ended = True


def advance(order, done: int, rank_len: int):
    """A rank's segment order once ``done`` of its samples are read (at most ``rank_len``, the samples
    it reads in the segment: padding past the end counts as read): the elastic rule's count
    (``replay.py``'s docstring). A ``DistributedOrder`` or ``DALIGlobalOrder`` counts the samples of
    every rank in the global order (``consumed``, ``world`` per rank's sample); a ``DALIShardOrder``
    advances its last segment, the one this rank is reading."""
    step = min(done, rank_len)
    if isinstance(order, (DistributedOrder, DALIGlobalOrder)):
        return dataclasses.replace(order, consumed=order.consumed + order.world * step)
    if isinstance(order, DALIShardOrder):
        segments = [list(x) for x in order.sampler["segments"]]
        segments[-1][1] += step
        return DALIShardOrder({**order.sampler, "segments": segments})
    raise TypeError(f"not a segment order: {type(order).__name__}")


class EpochRecord:
    """The epoch an iterator is in: what the loader's ``state_dict()`` is built from."""

    def __init__(self, epoch: int, plan: LoaderState | DALIState | None, sample_seed: int | None = None,
                 loader_generator=None) -> None:
        self.epoch, self.plan, self.sample_seed = epoch, plan, sample_seed
        self.loader_generator = loader_generator
        self.base = 0               # batches of the epoch counted before this iterator's first one
        self.batches = 0            # yielded by this iterator (a resumed one counts from the resume)
        self.finished = False
        # how the order is rebuilt (at its first index; DALI: the segment the epoch reads)
        self.order: ReplayOrder | DistributedOrder | DALIShardOrder | DALIGlobalOrder | None = None
        self.rank_len: int | None = None  # distributed: samples this rank reads in this segment
        self.fetcher = None         # iterable, num_workers=0: torch's fetcher (its iterator and ``ended``)
        self.workers: WorkerStates | None = None   # iterable, num_workers>0: the latest per-worker states
        self.snapshot: WorkerStates | None = None  # ... as of the last snapshot step (``snapshot_at``)
        self.snapshot_at = 0
        self.worker_seed: int | None = None  # torch's base seed of this epoch's worker processes
        self.ahead: tuple[int, ...] = plan.ahead if plan is not None else ()  # in_order=False: positions
        self.front: int | None = None  # ... past ``front``, the first position not yielded, already yielded

    @property
    def position(self) -> int:
        return self.base + self.batches


class ResumeTracker:
    """One loader's resume bookkeeping: the loaded plan, the live epoch, the state in and out.

    Args:
        loader: the ``fastload.DataLoader``.
        snapshot_every: torchdata's ``snapshot_every_n_steps``: with an iterable dataset and
            workers, the workers send their dataset's state with every batch (1) or only around
            every n-th step; a state taken in between resumes from the last snapshot and reads
            the batches since then again.
    """

    def __init__(self, loader, snapshot_every: int) -> None:
        self._loader = weakref.ref(loader)
        self.snapshot_every = snapshot_every
        self._ahead_said = False
        self.plan: LoaderState | None = None
        self.live: EpochRecord | None = None
        self.index = None  # the ResumableIndex around the loader's index sampler (_resume_iter.py)
        self.iterable = isinstance(loader.dataset, IterableDataset)
        # a map-style dataset with torchdata's state_dict()/load_state_dict() (e.g. one drawing from
        # torch's RNG in __getitem__): its state is kept as torchdata keeps it, per worker process
        self.map_stateful = (not self.iterable and getattr(loader, "backend", "processes") == "processes"
                             and is_stateful(loader.dataset))
        self.seeding = (not self.iterable and loader.batch_sampler is not None
                        and _replay.uses_fastload_preset(loader.dataset))
        self._ident: tuple[str | None] | None = None

    # ---- what the loader asks ---------------------------------------------------------------

    def generators(self, loader) -> dict[str, torch.Generator]:
        gens = {"global": torch.default_generator}
        if isinstance(loader.generator, torch.Generator):
            gens["loader"] = loader.generator
        return gens

    @staticmethod
    def distributed(loader) -> DistributedSampler | None:
        for s in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
            if isinstance(s, DistributedSampler):
                return s
        return None

    @staticmethod
    def shard_sampler(loader):
        """The loader's ``ShardSampler`` (its seed and epoch count like DistributedSampler's), or None."""
        from fastload.load.shards import ShardSampler

        for s in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
            if isinstance(s, ShardSampler):
                return s
        return None

    def iterator(self, loader, new_iterator):
        """This epoch's iterator (``new_iterator()``), positioned where a loaded plan says."""
        plan = self.plan
        if plan is None:
            return new_iterator()
        if not plan.batches and not plan.ahead and (plan.order is not None or plan.worker_seed is not None):
            now = self._next_epoch_draws(loader)
            if (now.get("order"), now.get("worker_seed")) == (plan.order, plan.worker_seed) \
                    and now.get("sample_seed", plan.sample_seed) == plan.sample_seed:
                # the RNG is where the saving run's was (the user restored it with the state): the
                # epoch draws as it did, and leaves the RNG where the uninterrupted run's went on from
                plan = self.plan = dataclasses.replace(plan, order=None, worker_seed=None, sample_seed=None)
        if plan.order is None and not plan.batches and plan.workers is None and plan.fetcher is None:
            # saved between epochs: this epoch starts as any epoch does, from the RNG as it is now
            if (self.iterable or self.map_stateful) and plan.dataset_state is not None:
                loader.dataset.load_state_dict(plan.dataset_state)  # then iter() draws as the next epoch would
            return new_iterator()
        if self.iterable and loader.num_workers == 0 and plan.dataset_state is not None:
            loader.dataset.load_state_dict(plan.dataset_state)  # 1. the dataset, 2. iter() (torch), 3. its iterator
        gens = self.generators(loader)
        if isinstance(plan.order, ReplayOrder):
            # the replay puts the loader's generator where the saved epoch's order left it
            # (ResumableIndex._replay), not the saved "generator", which depends on how far the
            # saving run's workers or threads had read ahead; only torch's global RNG is kept
            gens = {"global": gens["global"]}
        now = _replay.rng_snapshot(gens)
        user_rng = False  # a loaded iterator state may set torch's RNG itself (torchdata's tests' do)
        try:  # building the resumed iterator must not consume the user's random draws
            it = new_iterator()
            _replay.rng_restore(gens, now)
            rec = self.live
            if self.map_stateful and plan.dataset_state is not None:
                loader.dataset.load_state_dict(plan.dataset_state)
                user_rng = True
            if self.iterable and plan.fetcher is not None and rec is not None and rec.fetcher is not None:
                fetcher = rec.fetcher
                if plan.fetcher.iter_state is not None and is_stateful(fetcher.dataset_iter):
                    fetcher.dataset_iter.load_state_dict(plan.fetcher.iter_state)
                    user_rng = True
                if plan.fetcher.ended:
                    settle_ended(fetcher, loader.dataset, plan.dataset_state, plan.fetcher.iter_state)
            if self.iterable and rec is not None:
                for _ in range(plan.batches - rec.base):  # no state (or a snapshot behind): read them again
                    next(it)
        finally:
            if not user_rng:
                _replay.rng_restore(gens, now)
        return it

    def facts(self, loader) -> dict:
        if self._ident is None:
            self._ident = (_replay.dataset_identity(loader.dataset),)
        dist_sampler = self.distributed(loader) or self.shard_sampler(loader)
        if dist_sampler is not None:
            seed = dist_sampler.seed
        else:
            seed = loader.generator.initial_seed() if isinstance(loader.generator, torch.Generator) else None
        try:
            length = len(loader.dataset)
        except TypeError:
            length = None
        return {"kind": "iterable" if self.iterable else "map", "length": length,
                "identity": self._ident[0], "seed": seed, "distributed": self.distributed(loader) is not None}

    # ---- what the iterators report ----------------------------------------------------------

    def saved_worker_seed(self) -> int | None:
        """The loaded mid-epoch state's worker base seed, for the iterator about to start workers."""
        plan = self.plan
        return plan.worker_seed if plan is not None else None

    def epoch_started(self, it) -> int:
        """A new iterator starts its epoch; returns the worker to read first (iterable, workers)."""
        loader = self._loader()
        plan, self.plan = self.plan, None
        seed = None
        dist_sampler = self.distributed(loader) or self.shard_sampler(loader)  # seed and epoch from it
        if self.seeding:
            if plan is not None and plan.sample_seed is not None:
                seed = plan.sample_seed
            elif dist_sampler is not None:  # the same on every rank, whatever the world size
                seed = _replay.mix_seed(dist_sampler.seed, 0x5EED)
            else:
                seed = int(it._base_seed)
        epoch = dist_sampler.epoch if dist_sampler is not None else loader.epoch - 1  # the user may set_epoch
        rec = EpochRecord(epoch, plan, seed, loader.generator)
        if plan is not None:
            rec.base = plan.batches if not self.iterable else self._resumed_base(plan, loader.num_workers)
        rotate = 0
        if (self.iterable or self.map_stateful) and loader.num_workers > 0:
            n = loader.num_workers
            saved = plan.workers if plan is not None else None
            if saved is not None:
                saved = dataclasses.replace(saved, replay=0, rng=())  # the RNGs: given to the new workers
            rec.workers = saved or WorkerStates(num_workers=n, states=(None,) * n, next=0,
                                                iter_states=(None,) * n, ended=(None,) * n)
            rec.snapshot, rec.snapshot_at = rec.workers, rec.base
            rotate = rec.workers.next
        if loader.num_workers > 0:
            rec.worker_seed = getattr(it, "_base_seed", None)
        if self.iterable and loader.num_workers == 0:
            rec.fetcher = getattr(it, "_dataset_fetcher", None)
        self.live = rec
        if not self.iterable:
            self.index.live = rec  # read at the epoch's first index, maybe after the loader is gone
        return rotate

    @staticmethod
    def _resumed_base(plan: LoaderState, num_workers: int) -> int:
        """Batches of a resumed iterable epoch its states already account for (the rest are read again)."""
        if num_workers == 0:
            stateful = plan.dataset_state is not None or (plan.fetcher is not None
                                                          and plan.fetcher.iter_state is not None)
            return plan.batches if stateful else 0
        w = plan.workers
        if w is None or all(s is None for s in (*w.states, *w.iter_states)):
            return 0
        return plan.batches - w.replay

    def out_of_order(self, received: int, ahead: list[int]) -> None:
        """``in_order=False`` (map-style, workers): the iterator's batches ``< received`` and those in
        ``ahead`` (its own send indices) are yielded; kept as epoch positions (``ahead``)."""
        rec = self.live
        if rec is None or self.iterable:
            return
        skipped = rec.plan.ahead if rec.plan is not None else ()
        pos, nxt, i = [], rec.base, 0
        todo = sorted(set(ahead) | {received})
        for want in todo:  # send index i -> the i-th position from base that the resume did not skip
            while True:
                if nxt not in skipped:
                    if i == want:
                        break
                    i += 1
                nxt += 1
            pos.append(nxt)
        front = pos[todo.index(received)]
        rec.front = front
        rec.ahead = tuple(sorted({p for p in pos if p > front or (p == front and received in ahead)}
                                 | {p for p in skipped if p >= front}))
        if front in rec.ahead:  # the batch at ``received`` was yielded too: the front moves past the run
            while front in rec.ahead:
                front += 1
            rec.front = front
            rec.ahead = tuple(p for p in rec.ahead if p > front)

    def batch_yielded(self) -> None:
        rec = self.live
        if rec is None:
            return
        rec.batches += 1
        if rec.batches == 1:  # this iterator's first batch: the loader times it (time to first batch)
            loader = self._loader()
            if loader is not None and hasattr(loader, "first_batch_arrived"):
                loader.first_batch_arrived(rec.epoch)
        if rec.workers is not None and (self.map_stateful or (self.snapshot_every
                                                              and rec.position % self.snapshot_every == 0)):
            rec.snapshot, rec.snapshot_at = rec.workers, rec.position

    def worker_state(self, worker_id: int, state, iter_state, ended: bool, *, batch: bool, rng=None) -> None:
        """Worker ``worker_id``'s dataset (and iterator) state after the batch now handed out
        (``batch``), or after it ran out (no batch: torch skips the worker from then on; with
        persistent workers, ``rng``: the worker's RNG states then, which its next epoch draws from)."""
        rec = self.live
        if rec is None or rec.workers is None:
            return
        w = rec.workers
        n = w.num_workers

        def put(values: tuple, value) -> tuple:
            return (*values[:worker_id], value, *values[worker_id + 1:])

        rec.workers = dataclasses.replace(
            w, states=put(w.states, state), iter_states=put(w.iter_states or (None,) * n, iter_state),
            ended=put(w.ended or (None,) * n, ended), next=(worker_id + 1) % n if batch else w.next,
            rng=put(w.rng or (None,) * n, rng) if rng is not None else w.rng)

    def epoch_ended(self) -> None:
        if self.live is not None:
            self.live.finished = True

    # ---- the state in and out ---------------------------------------------------------------

    def state_dict(self, loader) -> dict:
        if self.plan is not None:  # loaded and not started yet: the same position
            return self.plan.to_dict()
        facts = self.facts(loader)
        rec = self.live
        gen = loader.generator
        st = LoaderState(
            dataset=_state.DatasetFacts(kind=facts["kind"], len=facts["length"], identity=facts["identity"]),
            epoch=rec.epoch + 1 if rec is not None else loader.epoch, batches=0, batch_size=loader.batch_size,
            seed=facts["seed"], generator=bytes(gen.get_state().numpy().tobytes())
            if isinstance(gen, torch.Generator) else None,
            order=None, sample_seed=None, dataset_state=None, workers=None)
        changes: dict = {}
        if rec is not None and not rec.finished:
            changes.update(epoch=rec.epoch, batches=rec.position if rec.front is None else rec.front,
                           ahead=rec.ahead, sample_seed=rec.sample_seed, worker_seed=rec.worker_seed)
            order = rec.order
            if order is None and not self.iterable:  # iter() was called, next() not yet
                order = self.index.pending_order(rec)
            if isinstance(order, DistributedOrder) and rec.batches:
                per = loader.batch_size if loader.batch_sampler is not None else 1
                # the rank's batches up to the first it has not yielded (in_order=False yields later ones
                # ahead of it: counting those as read lost the batches before them)
                done = (rec.front if rec.front is not None else rec.position) - rec.base
                order = advance(order, done * per, rec.rank_len)
                if rec.ahead:
                    # a DistributedSampler's resume is one offset into the global order, the same for every
                    # rank: batches a rank yielded ahead of its turn are read again after a resume, never lost
                    if not self._ahead_said:
                        self._ahead_said = True
                        log.warning("loader state under DistributedSampler with in_order=False: %d batch(es) "
                                    "handed out ahead of their turn will be read again after a resume (none is "
                                    "lost); in_order=True resumes exactly", len(rec.ahead))
                    changes["ahead"] = ()
            changes["order"] = order
            if rec.workers is not None:
                changes["workers"] = dataclasses.replace(rec.snapshot, replay=rec.position - rec.snapshot_at)
            if rec.fetcher is not None:
                changes.update(self._single_process_states(loader.dataset, rec.fetcher))
        else:  # before the first iter() or between epochs: the draws the next iter() will make
            changes.update(self._next_epoch_draws(loader))
        if (rec is None or rec.finished) and self.iterable and loader.num_workers == 0 \
                and is_stateful(loader.dataset):
            changes["dataset_state"] = loader.dataset.state_dict()  # between epochs
        if rec is not None and rec.finished and rec.workers is not None and loader.persistent_workers:
            # between epochs, persistent workers: the next epoch reads the workers' dataset copies
            # as the last one left them (not fresh copies of this process's dataset), and draws from
            # the RNGs the workers ended with, so a resumed loader's new workers get those states and
            # RNGs; their iterators and ends were the last epoch's
            n = rec.workers.num_workers
            changes["workers"] = WorkerStates(num_workers=n, states=rec.workers.states, next=0,
                                              iter_states=(None,) * n, ended=(None,) * n,
                                              rng=rec.workers.rng or (None,) * n)
        if self.map_stateful and loader.num_workers == 0:
            changes["dataset_state"] = loader.dataset.state_dict()
        return dataclasses.replace(st, **changes).to_dict()

    def _next_epoch_draws(self, loader) -> dict:
        """What the next ``iter()`` will draw from torch's RNG (the loader's ``generator`` or the
        global one), drawn here on copies so nothing of the user's RNG is consumed: the workers' base
        seed (``worker_seed``; not drawn again for persistent workers already running) and, for a
        map-style dataset, the RNG state the order is then drawn from (``order``). A state taken
        before ``iter()`` or between epochs thus resumes the epoch the saving loader would run next,
        whatever a resumed process's global RNG is (torchdata keeps the same, drawing them for real)."""
        reuse = loader.persistent_workers and getattr(loader, "_iterator", None) is not None
        if (loader.num_workers > 0 and reuse and self.iterable) or (self.map_stateful and loader.num_workers == 0):
            return {}  # (the stateful dataset's own state is loaded before iter(), which then draws as this one)
        if not self.iterable:
            if self.distributed(loader) is not None or self.shard_sampler(loader) is not None:
                return {}  # their order is their seed and epoch, already in the state
            _ = loader._index_sampler  # makes the ResumableIndex when iter() was never called
        gens = self.generators(loader)
        before = _replay.rng_snapshot(gens)
        changes: dict = {}
        try:
            if not reuse:  # a new iterator draws its base seed first (torch's _BaseDataLoaderIter)
                seed = int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item())
                if loader.num_workers > 0:
                    changes["worker_seed"] = seed
                if self.seeding:
                    changes["sample_seed"] = seed
            if not self.iterable:
                changes["order"] = self.index.order_now(EpochRecord(0, None, None, loader.generator))
        finally:
            _replay.rng_restore(gens, before)
        return changes

    @staticmethod
    def _single_process_states(dataset, fetcher) -> dict:
        """torchdata's rule: the dataset's state unless it is its own iterator, the iterator's if it
        has one, and whether it ran out (a state taken after the epoch's last batch resumes empty)."""
        it = fetcher.dataset_iter
        ds_state = dataset.state_dict() if is_stateful(dataset) and it is not dataset else None
        it_state = it.state_dict() if is_stateful(it) else None
        return {"dataset_state": ds_state, "fetcher": FetcherState(iter_state=it_state, ended=bool(fetcher.ended))}

    def load(self, loader, sd) -> None:
        facts = self.facts(loader)
        st = _state.check_state(sd, kind=facts["kind"], length=facts["length"], identity=facts["identity"],
                                seed=facts["seed"], batch_size=loader.batch_size,
                                distributed=facts["distributed"], num_workers=loader.num_workers)
        if not self.iterable and not self.map_stateful and (st.dataset_state is not None or st.workers is not None):
            raise ResumeStateError(
                "loader state holds a map-style dataset's own state (saved by backend='processes' over a dataset "
                "with state_dict()/load_state_dict()); this loader cannot give it back (backend="
                f"{getattr(loader, 'backend', 'processes')!r}, dataset {type(loader.dataset).__name__}).\nHINT: "
                "resume with backend='processes' over the same dataset class.")
        if self.iterable or self.map_stateful:
            if (st.dataset_state is not None or st.fetcher is not None) and loader.num_workers > 0:
                raise _state.mismatch_error("num_workers", 0, loader.num_workers, "the state holds one dataset "
                                            "state (saved with num_workers=0): resume with num_workers=0.")
        running = getattr(loader, "_iterator", None)
        if running is not None:
            # persistent workers hold dataset copies that cannot take the state (iterable
            # datasets) and indices already sent ahead: as torchdata does, the next iter()
            # starts fresh workers from the state
            loader._iterator = None
            shutdown = getattr(running, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        if st.generator is not None and isinstance(loader.generator, torch.Generator):
            loader.generator.set_state(torch.frombuffer(bytearray(st.generator), dtype=torch.uint8))
        self.live = None
        self.plan = st


class DALITracker:
    """``fastload.DALILoader``'s resume bookkeeping: the seam ``ResumeTracker`` is, for a loader with no
    torch iterator and no dataset states (its order is a function of seed, epoch and position).

    The loader reports ``epoch_started(...)`` (with the segment order the epoch reads, already
    positioned where a loaded plan said), ``batch_yielded()`` and ``epoch_ended()``; this builds
    and checks the typed ``DALIState``. What the loader is (source, store identity, seed, ...)
    comes from its ``resume_facts()``; how a loaded plan becomes the epoch's samples is the
    loader's (``dali.py``: it owns the store's order).
    """

    def __init__(self) -> None:
        self.plan: DALIState | None = None
        self.live: EpochRecord | None = None

    def check(self, loader, sd) -> DALIState:
        """``sd`` read and checked against ``loader`` (nothing changes: the caller may still refuse it)."""
        return _state.check_dali_state(sd, **loader.resume_facts())

    def load(self, plan: DALIState) -> None:
        """Resume from ``plan`` (checked) at the next epoch's start."""
        self.plan, self.live = plan, None

    def take_plan(self) -> DALIState | None:
        """The loaded plan, for the epoch about to start (a later ``state_dict()`` is the live one's)."""
        plan, self.plan = self.plan, None
        return plan

    def epoch_started(self, epoch: int, batches: int, order: DALIShardOrder | DALIGlobalOrder | None,
                      rank_len: int | None) -> None:
        """Epoch ``epoch`` starts at batch ``batches`` (a resume's), reading ``order`` from its start
        (``rank_len`` of this rank's samples; None: a folder, resumed by batch count)."""
        rec = self.live = EpochRecord(epoch, None)
        rec.base, rec.order, rec.rank_len = batches, order, rank_len

    def batch_yielded(self) -> None:
        if self.live is not None:
            self.live.batches += 1

    def epoch_ended(self) -> None:
        self.live = None  # the loader's own epoch count says which comes next

    def state_dict(self, loader) -> dict:
        if self.plan is not None:  # loaded and not started yet: the same position
            return self.plan.to_dict()
        facts = loader.resume_facts()
        rec = self.live
        epoch, batches, order = loader.epoch, 0, None
        if rec is not None:
            epoch, batches = rec.epoch, rec.position
            if rec.order is not None:
                order = advance(rec.order, rec.batches * loader.batch_size, rec.rank_len)
        return DALIState(source=facts["source"], len=facts["length"], identity=facts["identity"], seed=facts["seed"],
                         shuffle=facts["shuffle"], batch_size=facts["batch_size"], epoch=epoch, batches=batches,
                         order=order, world=facts["world"], shards=facts["shards"]).to_dict()
