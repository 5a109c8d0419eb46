"""Per-sample timing inside the dataset, in whichever process runs ``__getitem__``.

Owns: the size of a batch (tensor bytes, pinned or not, length), psutil readings of
each DataLoader worker's CPU time (``WorkerSampler``), the
wrap of the dataset class's ``__getitem__`` (wall and CPU time per sample), the
wraps of ``PIL.Image.open`` (read: opening the file and parsing its header),
``Image.load`` / ``Image.convert`` (decode) and torchvision's ``Compose.__call__``
(transform, timed per transform so ToTensor/Normalize can be told apart), the hook that
times fastload's own marked work (``fastload.marks``: the store readers' ``get``, the decoders,
the presets mark themselves ``@timed(part)``; nothing here names them), the time a
sample was blocked on a shard download of a remote store (download: the growth of
``fastload.store.cache``'s ``wait_s`` counter during ``__getitem__``), and the
``samples-rank<R>-<pid>.json`` file each process writes. Every 8th sample also reads the
thread's run-queue wait (``/proc/thread-self/schedstat``), which tells time waiting for a
CPU (an oversubscribed machine) from time blocked (I/O, sleep). Time inside ``__getitem__`` that
none of these saw is "other" (the user's own code: a sleep, a network read, augmentation
by hand). Only the outermost timed call counts, so a ``convert`` inside a transform is
transform time.

DataLoader workers are separate processes: forked ones inherit the wraps, spawned ones
get them from ``_WorkerInit`` (the loader's ``worker_init_fn``, wrapped). Workers end
with ``os._exit``, so each worker rewrites its file every 2 s (and after its 1st, 2nd,
4th, 8th... sample, so short runs and persistent workers that outlive the measurement are
seen) and once more from a multiprocessing finaliser (the last 2 s of a killed worker can
be lost); the training
process writes its file at exit only, off the step.

Must not: import torch, PIL or torchvision at module level, nor import PIL or torchvision
at all (it wraps what the script imported); patch fastload's own modules by name (a new
preset or reader marks itself with ``fastload.marks.timed`` and is timed unchanged).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

_LOCAL = threading.local()
FLUSH_EVERY_S = 2.0
SCHED_EVERY = 8  #: read the run-queue wait on every 8th sample (a /proc read costs a few microseconds)


def _rank() -> int:
    """This process's rank (torchrun's RANK, else Slurm's SLURM_PROCID); the probe keys its files by it too."""
    for key in ("RANK", "SLURM_PROCID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def _class_key(cls: type) -> str:
    module = "__main__" if cls.__module__ == "__mp_main__" else cls.__module__  # spawned workers' name for it
    return f"{module}.{cls.__qualname__}"


def dataset_key(dataset: Any) -> str:
    return _class_key(type(dataset))


class SampleStats:
    """Totals per dataset class in this process."""

    def __init__(self) -> None:
        self.out: Path | None = None
        self.pid = os.getpid()
        self.by_dataset: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._last_flush = 0.0
        self._finaliser = False
        self.main_pid: int | None = None  # the recorder's process flushes at exit only
        self._made_dir = False

    @property
    def n(self) -> int:
        return sum(d["n"] for d in self.by_dataset.values())

    def reset(self, out: Path | None) -> None:
        self.out, self.pid, self.by_dataset, self._finaliser, self._made_dir = out, os.getpid(), {}, False, False

    def add(self, key: str, wall: float, cpu: float, parts: dict[str, float], transforms: dict[str, float],
            runqueue: tuple[float, float] | None = None) -> None:
        if self.pid != os.getpid():  # a forked worker: the parent's totals are not ours
            self.reset(self.out)
        with self._lock:
            d = self.by_dataset.setdefault(key, {"n": 0, "total_s": 0.0, "cpu_s": 0.0, "read_s": 0.0,
                                                 "decode_s": 0.0, "transform_s": 0.0, "transforms": {},
                                                 "runqueue_s": 0.0, "runqueue_wall_s": 0.0, "download_s": 0.0})
            d["n"] += 1
            if runqueue is not None:
                d["runqueue_s"] += runqueue[0]
                d["runqueue_wall_s"] += runqueue[1]
            d["total_s"] += wall
            d["cpu_s"] += cpu
            for k, v in parts.items():
                d[k + "_s"] = d.get(k + "_s", 0.0) + v
            for k, v in transforms.items():
                d["transforms"][k] = d["transforms"].get(k, 0.0) + v
        if self.pid == self.main_pid:
            return
        now = time.perf_counter()
        n = self.by_dataset[key]["n"]
        if now - self._last_flush > FLUSH_EVERY_S or n & (n - 1) == 0:  # and at n = 1, 2, 4, 8, ...
            self._last_flush = now
            self.flush()
        if not self._finaliser:
            self._finaliser = True
            try:
                from multiprocessing import util

                util.Finalize(None, self.flush, exitpriority=100)
            except Exception:
                pass

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            snap = {"pid": self.pid, "rank": _rank(), "by_dataset": json.loads(json.dumps(self.by_dataset))}
        cache = sys.modules.get("fastload.store.cache")  # a remote store was read here: its counters
        if cache is not None:
            snap["shard_cache"] = cache.stats()
        return snap

    def flush(self) -> None:
        if self.out is None or not self.by_dataset or self.pid != os.getpid():
            return
        try:
            if not self._made_dir:
                self.out.mkdir(parents=True, exist_ok=True)
                self._made_dir = True
            path = self.out / f"samples-rank{_rank()}-{self.pid}.json"
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(self.snapshot()))
            os.replace(tmp, path)
        except OSError:
            pass


_STATS = SampleStats()


def stats() -> SampleStats:
    return _STATS


def _state() -> Any:
    loc = _LOCAL
    if not hasattr(loc, "depth"):
        loc.depth, loc.region, loc.parts, loc.transforms = 0, None, {}, {}
    return loc


def _runqueue_s() -> float | None:
    """Seconds this thread has spent runnable but waiting for a CPU (Linux ``schedstat``), or None."""
    st = _state()
    if getattr(st, "sched_pid", None) != os.getpid():  # /proc/thread-self names the thread that opened it
        st.sched_pid = os.getpid()
        try:
            st.sched_fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            st.sched_fd = None
    if st.sched_fd is None:
        return None
    try:
        return int(os.pread(st.sched_fd, 96, 0).split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _wrap_getitem(cls: type) -> None:
    lmdb = getattr(sys.modules.get("fastload.load.dataset"), "LMDBImageDataset", None)
    if lmdb is not None and issubclass(cls, lmdb):
        # fastload's dataset: time getitem(), which both __getitem__ and the thread pipeline call (the
        # pipeline calls it directly, and tells its own dataset by ``type(ds).__getitem__ is
        # LMDBImageDataset.__getitem__``: a wrap on a subclass would turn its fast path off)
        if not getattr(lmdb.getitem, "_fastload_profile", False):
            lmdb.getitem = _timed_sample(lmdb.getitem, None)
        # the thread pipeline's planned samples: plan() then, after a few other samples' plans, render()
        if not getattr(lmdb.plan, "_fastload_profile", False):
            lmdb.plan = _timed_phase(lmdb.plan, last=False)
        if not getattr(lmdb.render, "_fastload_profile", False):
            lmdb.render = _timed_phase(lmdb.render, last=True)
        if cls.__getitem__ is lmdb.__getitem__:
            return
    original = cls.__getitem__
    if getattr(original, "_fastload_profile", False):
        return
    cls.__getitem__ = _timed_sample(original, _class_key(cls))


class _Measured:
    """One timed call inside a sample, on this thread's state ``st``: fresh parts, wall and CPU time, the
    run queue when ``runqueue`` (``rq``: seconds runnable but waiting, or None), and time blocked on a shard
    download moved from the read part to its own."""

    def __init__(self, st: Any, runqueue: bool) -> None:
        self.st, self.runqueue, self.rq = st, runqueue, None

    def __enter__(self) -> _Measured:
        st = self.st
        st.depth, st.parts, st.transforms = 1, {"read": 0.0, "decode": 0.0, "transform": 0.0}, {}
        self.cache = sys.modules.get("fastload.store.cache")  # time blocked on a shard download is its own part
        self.w0 = self.cache._STATS.wait_s if self.cache is not None else None
        self.q0 = _runqueue_s() if self.runqueue else None
        self.t0, self.c0 = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc) -> bool:
        self.wall, self.cpu = time.perf_counter() - self.t0, time.thread_time() - self.c0
        if self.q0 is not None:
            q1 = _runqueue_s()
            self.rq = None if q1 is None else q1 - self.q0
        st = self.st
        st.depth = 0
        if self.w0 is not None:  # the wait happened inside the store read: it is download, not read
            waited = max(0.0, self.cache._STATS.wait_s - self.w0)
            st.parts["download"] = waited
            st.parts["read"] = max(0.0, st.parts["read"] - waited)
        return False


def _timed_sample(original, key: str | None):
    """``original`` (``__getitem__``-like) timed as one sample of ``key`` (None: the instance's class)."""

    def timed(self, index, *args, **kwargs):
        st = _state()
        if st.depth:
            return original(self, index, *args, **kwargs)
        st.count = getattr(st, "count", 0) + 1
        m = _Measured(st, st.count % SCHED_EVERY == 0)
        try:
            with m:
                return original(self, index, *args, **kwargs)
        finally:
            rq = None if m.rq is None else (m.rq, m.wall)
            _STATS.add(key or _class_key(type(self)), m.wall, m.cpu, st.parts, st.transforms, rq)

    return _marked(timed, original)


def _timed_phase(original, *, last: bool):
    """``original`` (``LMDBImageDataset.plan`` or ``render``) timed as one phase of a sample: a plan's wall
    and CPU time, parts and run-queue reading are kept per thread, under the planned object it returns,
    until that object's render, which adds its own and counts the sample once, as ``getitem`` would be
    counted. A phase that raises counts nothing: the sample is redone by ``getitem``, which counts it."""

    def timed(self, *args, **kwargs):
        st = _state()
        if st.depth:
            return original(self, *args, **kwargs)
        pending = getattr(st, "planned", None)
        if pending is None or len(pending) > 4096:  # plans whose render never came (the loader stopped)
            pending = st.planned = {}
        before = pending.pop(id(args[1]), None) if last and len(args) > 1 else None
        if not last:
            st.count = getattr(st, "count", 0) + 1
        sample_rq = (st.count % SCHED_EVERY == 0) if not last else (before is not None and before[4] is not None)
        with _Measured(st, sample_rq) as m:
            result = original(self, *args, **kwargs)
        if not last:
            pending[id(result)] = (m.wall, m.cpu, dict(st.parts), dict(st.transforms), m.rq)
            return result
        w, c, parts, transforms, rq_plan = before if before is not None else (0.0, 0.0, {}, {}, None)
        for name, v in parts.items():
            st.parts[name] = st.parts.get(name, 0.0) + v
        for name, v in transforms.items():
            st.transforms[name] = st.transforms.get(name, 0.0) + v
        runqueue = None if m.rq is None or rq_plan is None else (m.rq + rq_plan, m.wall + w)
        _STATS.add(_class_key(type(self)), m.wall + w, m.cpu + c, st.parts, st.transforms, runqueue)
        return result

    return _marked(timed, original)


def _marked(inner, fn):
    """``inner``, the profiling wrap of ``fn``: marked so that it is never wrapped twice, and named as ``fn``."""
    inner._fastload_profile = True  # type: ignore[attr-defined]
    inner.__wrapped__ = fn  # type: ignore[attr-defined]
    inner.__name__ = getattr(fn, "__name__", "wrapped")
    inner.__doc__ = getattr(fn, "__doc__", None)
    return inner


def _timed(fn, part: str):
    if getattr(fn, "_fastload_profile", False):
        return fn

    def inner(*args, **kwargs):
        st = _state()
        if not st.depth or st.region is not None:
            return fn(*args, **kwargs)
        st.region = part
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            st.region = None
            st.parts[part] += time.perf_counter() - t0

    return _marked(inner, fn)


def _run_marked(mark, fn, args, kwargs):
    """The hook of ``fastload.marks``: a marked call (``@timed(part)``) inside a sample, timed as ``mark.part``.

    ``own`` (fastload's presets decode inside the transform: ``from_bytes`` is decode + crop/resize/flip):
    less the marked work timed inside it; ``per_class``: also counted per transform, by the class name."""
    st = _state()
    if not st.depth or st.region is not None:
        return fn(*args, **kwargs)
    if not mark.own:
        st.region = mark.part
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            st.region = None
            st.parts[mark.part] += time.perf_counter() - t0
    before = sum(st.parts.values())
    t0 = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        own = max(0.0, time.perf_counter() - t0 - (sum(st.parts.values()) - before))
        st.parts[mark.part] += own
        if mark.per_class and args:
            name = type(args[0]).__name__
            st.transforms[name] = st.transforms.get(name, 0.0) + own


def _compose_call(original):
    if getattr(original, "_fastload_profile", False):
        return original

    def __call__(self, img):
        st = _state()
        if not st.depth or st.region is not None:
            return original(self, img)
        for t in self.transforms:  # torchvision.transforms.Compose.__call__, one transform at a time
            st.region = "transform"
            t0 = time.perf_counter()
            try:
                img = t(img)
            finally:
                st.region = None
                dt = time.perf_counter() - t0
                st.parts["transform"] += dt
                name = type(t).__name__
                st.transforms[name] = st.transforms.get(name, 0.0) + dt
        return img

    __call__._fastload_profile = True  # type: ignore[attr-defined]
    return __call__


def patch_libraries() -> None:
    """Wrap PIL and torchvision.transforms where imported, and time fastload's marked work (idempotent)."""
    image = sys.modules.get("PIL.Image")
    if image is not None:
        image.open = _timed(image.open, "read")
        image.Image.load = _timed(image.Image.load, "decode")
        image.Image.convert = _timed(image.Image.convert, "decode")
        try:  # JPEG and PNG files override load() on their ImageFile subclass
            from PIL import ImageFile

            ImageFile.ImageFile.load = _timed(ImageFile.ImageFile.load, "decode")
        except ImportError:
            pass
    transforms = sys.modules.get("torchvision.transforms.transforms")
    if transforms is not None:
        transforms.Compose.__call__ = _compose_call(transforms.Compose.__call__)
    from fastload import marks  # fastload's own work (store reads, decoders, presets) is marked where written

    marks.instrument(_run_marked)


class _WorkerInit:
    """The loader's ``worker_init_fn``, preceded by the wraps (spawned workers do not inherit them)."""

    def __init__(self, inner, out: str | None) -> None:
        self.inner, self.out = inner, out

    def __call__(self, worker_id: int) -> None:
        import signal

        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL and getattr(
                signal.getsignal(signal.SIGTERM), "__module__", "") == "fastload.profiling._probe":
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's handler writes the parent's file
        if _STATS.pid != os.getpid():
            _STATS.reset(Path(self.out) if self.out else None)
        elif self.out and _STATS.out is None:
            _STATS.out = Path(self.out)
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        if info is not None and hasattr(type(info.dataset), "__getitem__"):
            _wrap_getitem(type(info.dataset))
        patch_libraries()
        if self.inner is not None:
            self.inner(worker_id)


def prepare_loader(loader: Any, out: Path | None) -> None:
    """Before a DataLoader starts its workers: wrap its dataset class, PIL, transforms, worker init."""
    dataset = getattr(loader, "dataset", None)
    from torch.utils.data import IterableDataset

    if dataset is not None and not isinstance(dataset, IterableDataset) and hasattr(type(dataset), "__getitem__"):
        _wrap_getitem(type(dataset))
    patch_libraries()
    if (getattr(loader, "num_workers", 0) and getattr(loader, "backend", None) != "threads"  # threads: no processes
            and not isinstance(getattr(loader, "worker_init_fn", None), _WorkerInit)):
        loader.worker_init_fn = _WorkerInit(loader.worker_init_fn, str(out) if out else None)


class WorkerSampler:
    """CPU seconds of each DataLoader worker pid (psutil), first and last reading, every 0.25 s."""

    def __init__(self) -> None:
        self.readings: dict[int, list[float]] = {}  # pid -> [t_first, cpu_first, t_last, cpu_last]
        self._pids: set[int] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def watch(self, pids: set[int]) -> None:
        with self._lock:
            self._pids |= pids
        self._read()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fastload-profile-psutil", daemon=True)
            self._thread.start()

    def _read(self) -> None:
        try:
            import psutil
        except ImportError:
            return
        with self._lock:
            pids = list(self._pids)
        for pid in pids:
            try:
                times = psutil.Process(pid).cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                with self._lock:
                    self._pids.discard(pid)
                continue
            now, cpu = time.perf_counter(), times.user + times.system
            row = self.readings.setdefault(pid, [now, cpu, now, cpu])
            row[2], row[3] = now, cpu

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            self._read()

    def stop(self) -> dict[str, dict[str, float]]:
        self._stop.set()
        self._read()
        return {str(pid): {"cpu_s": r[3] - r[1], "wall_s": r[2] - r[0]} for pid, r in self.readings.items()
                if r[2] > r[0]}


def batch_nbytes(obj: Any, depth: int = 0) -> tuple[int, bool | None]:
    """Bytes of every tensor / array in a batch, and whether the first tensor is pinned."""
    if depth > 4:
        return 0, None
    if hasattr(obj, "element_size") and hasattr(obj, "nelement"):
        pinned = None
        if getattr(obj, "device", None) is not None and obj.device.type == "cpu":
            try:
                pinned = bool(obj.is_pinned())
            except RuntimeError:
                pinned = False
        return obj.element_size() * obj.nelement(), pinned
    if hasattr(obj, "nbytes") and hasattr(obj, "dtype"):
        return int(obj.nbytes), None
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    total, pinned = 0, None
    for x in items:
        n, p = batch_nbytes(x, depth + 1)
        total += n
        pinned = p if pinned is None else pinned
    return total, pinned


def batch_len(obj: Any) -> int:
    first = obj
    for _ in range(4):
        if isinstance(first, dict) and first:
            first = next(iter(first.values()))
        elif isinstance(first, (list, tuple)) and first:
            first = first[0]
        else:
            break
    shape = getattr(first, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) > 0 else 1
