"""The recorder that runs *inside* the profiled process: per-step data wait on every loader.

Owns: the patch of ``torch.utils.data.DataLoader.__iter__`` (which covers
``fastload.DataLoader``, a subclass), the per-loader step tracks, the headspace replay,
the Kineto window on CUDA, and the
rank file (``probe-rank<R>-<pid>.json``) written at exit, on SIGTERM, on Ctrl-C or when
``--steps``/``--seconds`` is reached; the append-only ``steps-rank<R>-<pid>.jsonl`` (one
unbuffered write per finished step) that an abrupt end (``os._exit``, SIGKILL, an OOM kill)
leaves behind; the check of ``num_workers="auto"`` given to torch's own DataLoader; and
``--verify-fix``'s changes made to the training loader (``FASTLOAD_PROFILE_APPLY``: options set on it, or
the uint8 presets swapped in by ``_uint8.py``, whose batch conversion runs inside the timed ``next()``).
Per-sample timing inside the dataset and psutil sampling of the DataLoader workers live in
``_samples.py``.

A step is one ``next()`` on a loader: it spans from the start of that ``next()`` to the
start of the following one, so ``data wait`` is the time blocked in ``next()`` and the
rest of the span is the training step's own work. The last batch of an iterator ends
where ``next()`` raised ``StopIteration``; a loop left with ``break`` loses its last step.

Must not: import torch at import time (``sitecustomize`` imports this module in every
Python process the command starts, torchrun's launcher included), analyse or print
(``_profile_report.py`` does).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fastload.profiling import _samples

ENV_OUT = "FASTLOAD_PROFILE_OUT"
ENV_STEPS = "FASTLOAD_PROFILE_STEPS"
ENV_WARMUP = "FASTLOAD_PROFILE_WARMUP"
ENV_REPLAY = "FASTLOAD_PROFILE_REPLAY"
ENV_KINETO = "FASTLOAD_PROFILE_KINETO_STEPS"
ENV_BUDGET = "FASTLOAD_PROFILE_SECONDS"
ENV_APPLY = "FASTLOAD_PROFILE_APPLY"
#: what ``--verify-fix`` can change on a loader from outside: two options, and the uint8 presets on a torchvision
#: ImageFolder (``_uint8.py``: the dataset's transform translated, the batches converted back to what the loop had)
APPLICABLE = ("num_workers", "pin_memory", "uint8_presets")
LOADER_OPTIONS = ("num_workers", "pin_memory")

_HERE = str(Path(__file__).resolve().parent)
MAX_EVENT_STEPS = 20_000  #: hand-off CUDA event pairs kept per loader
_TORCH_DIR = None  # set on first use: frames inside torch are not the user's loop


_rank = _samples._rank  # one rule for the probe's and the samples' files, or ranks are mixed up
RUNQUEUE_EVERY = 4  #: read the process's run-queue wait on every 4th step (a /proc read per thread)


def process_runqueue_s() -> float | None:
    """Seconds all threads of this process have spent runnable but waiting for a CPU (Linux), or None."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the thread ended meanwhile
    return total / 1e9


def short_path(name: str) -> str:
    """``name`` relative to the working directory when it is inside it (loader keys read better)."""
    cwd = os.getcwd()
    return name[len(cwd) + 1:] if name.startswith(cwd + os.sep) else name


_INSTALLED = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def _not_users(filename: str, ours: tuple[str, ...]) -> bool:
    """Code that is not the user's: torch, fastload's profiling/measure/load rooms, any installed package
    (Lightning, accelerate, ... run the user's ``train_dataloader()`` and ``for`` loop from inside their own
    code, so the first frame outside them is the user's line)."""
    return filename.startswith(ours) or any(part in filename for part in _INSTALLED)


def _ours() -> tuple[str, ...]:
    global _TORCH_DIR
    if _TORCH_DIR is None:
        import torch

        _TORCH_DIR = str(Path(torch.__file__).resolve().parent)
    return _TORCH_DIR, _HERE, str(Path(_HERE).parent / "load"), str(Path(_HERE).parent / "measure")


def _user_frame(depth: int = 3):
    """The first frame outside torch, fastload's profiling/measure/load rooms and installed packages."""
    ours = _ours()
    frame = sys._getframe(depth)
    while frame is not None:
        if not _not_users(frame.f_code.co_filename, ours):
            return frame
        frame = frame.f_back
    return None


def _construction_site(loader: Any, depth: int) -> str | None:
    """Absolute ``file:line`` of the user's ``DataLoader(...)`` call for ``loader`` being constructed now.

    A loader rebuilt by a framework from one the user made (Lightning's ``_update_dataloader``, which
    re-instantiates the loader with a ``DistributedSampler``) takes the site of the one it was built from:
    a frame between here and the user's line holds that loader in a local.
    """
    ours = _ours()
    frame = sys._getframe(depth)
    while frame is not None:
        if not _not_users(frame.f_code.co_filename, ours):
            return f"{os.path.abspath(frame.f_code.co_filename)}:{frame.f_lineno}"
        try:
            values = list(frame.f_locals.values())
        except Exception:  # an exotic frame: no inheritance from it
            values = []
        for value in values:
            try:
                site = vars(value).get("_fastload_created_at")
            except Exception:  # no __dict__ (or a proxy that refuses): not a loader
                continue
            if value is not loader and isinstance(site, str):
                return site
        frame = frame.f_back
    return None


def _call_site() -> str:
    """``file:line`` of the user's ``for`` line (the first frame outside torch, fastload and installed packages)."""
    frame = _user_frame()
    return "?" if frame is None else f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno}"


class Track:
    """Every ``next()`` on one loader (all its epochs), in ``perf_counter`` seconds."""

    def __init__(self, key: str, loader: Any, index: int) -> None:
        self.key, self.index = key, index
        self.kind = type(loader).__name__
        self.meta: dict[str, Any] = {"class": f"{type(loader).__module__}.{type(loader).__qualname__}"}
        for attr in ("num_workers", "pin_memory", "prefetch_factor", "batch_size", "persistent_workers", "backend"):
            value = getattr(loader, attr, None)
            if value is None or isinstance(value, (bool, int, float, str)):
                self.meta[attr] = value
        dataset = getattr(loader, "dataset", None)
        self.meta["dataset"] = None if dataset is None else _samples.dataset_key(dataset)
        if dataset is not None and "torchvision" in sys.modules:  # the store advice: its folder, files, preset
            from fastload.profiling import _uint8

            try:
                self.meta["image_folder"] = _uint8.describe(dataset)
            except Exception as exc:  # noqa: BLE001 - the user's dataset, any state: advice only, never the run
                self.meta["image_folder"] = {"refused": f"{type(exc).__name__}: {exc}"}
        self.meta["created_at"] = getattr(loader, "_fastload_created_at", None)  # the user's DataLoader(...) line
        self.autotuner = getattr(loader, "autotuner", None)  # fastload's thread loader sizing itself (autotune.py)
        # [start, wait, total, images, process CPU s, main-thread CPU s, run-queue s]: the CPU figures cover
        # the step's own part (from next() returning to the next call), i.e. the training process's compute;
        # run-queue: its threads' time waiting for a CPU in that part (every RUNQUEUE_EVERY-th step, else -1)
        self.steps: list[list[float]] = []
        self.pending: list[float] | None = None  # the last batch, until the next call starts
        self.batch_bytes: int | None = None
        self.pinned: bool | None = None
        self.worker_pids: set[int] = set()
        self.cache: list[Any] = []  # headspace: the first batches, replayed
        self.events: list[tuple[int, Any, Any]] = []  # (step, CUDA event before next(), after it)
        self.cpu_after: tuple[float, float] = (0.0, 0.0)  # process and thread CPU time as next() returned
        self.rq_after: float | None = None
        self.logged = False  # its header line is in the append-only steps file

    def event_idle(self) -> list[list[float]]:
        """Per step ``[step, GPU idle seconds during its next()]`` from the hand-off events.

        The event recorded as ``next()`` starts completes when the GPU has finished the
        work queued before it; the one recorded as ``next()`` returns completes at once if
        the queue is empty. The time between them on the GPU is the GPU idle the wait caused.
        """
        import torch

        torch.cuda.synchronize()
        return [[i, max(0.0, a.elapsed_time(b) / 1e3)] for i, a, b in self.events]

    def call_started(self, t: float) -> list[float] | None:
        """End the pending step at ``t``; return it (None when there was none)."""
        if self.pending is None:
            return None
        start, wait, images = self.pending
        pcpu, tcpu = self.cpu_after
        rq = -1.0
        if self.rq_after is not None:
            now = process_runqueue_s()
            rq = -1.0 if now is None else max(0.0, now - self.rq_after)
        step = [start, wait, t - start, images, time.process_time() - pcpu, time.thread_time() - tcpu, rq]
        self.steps.append(step)
        self.pending = None
        return step

    def got(self, start: float, end: float, batch: Any) -> None:
        if self.batch_bytes is None:
            self.batch_bytes, self.pinned = _samples.batch_nbytes(batch)
        self.pending = [start, end - start, float(_samples.batch_len(batch))]
        self.rq_after = process_runqueue_s() if len(self.steps) % RUNQUEUE_EVERY == 0 else None
        self.cpu_after = (time.process_time(), time.thread_time())

    def header(self) -> dict[str, Any]:
        meta = self.meta
        if self.autotuner is not None:  # its decisions so far (the rank file, written at the end, has them all)
            meta = {**meta, "autotune": [d.as_dict() for d in list(self.autotuner.decisions)]}
        return {"key": self.key, "kind": self.kind, "meta": meta, "batch_bytes": self.batch_bytes,
                "pinned": self.pinned}


class _TimedIter:
    """Wraps one loader iterator: times each ``next()``; in headspace mode, replays cached batches."""

    def __init__(self, inner: Any, track: Track, recorder: Recorder, length: int | None) -> None:
        self._inner, self._track, self._rec = inner, track, recorder
        self._length, self._served = length, 0
        self._replay = recorder.replay_key is not None and recorder.replay_key == track.key
        workers = getattr(inner, "_workers", None) or ()
        pids = {w.pid for w in workers if getattr(w, "pid", None)}
        if pids:
            track.worker_pids |= pids
            recorder.sampler.watch(pids)

    def __iter__(self) -> _TimedIter:
        return self

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __next__(self) -> Any:
        rec, track = self._rec, self._track
        rec.log_step(track, track.call_started(time.perf_counter()))
        rec.before_call(track)  # may start/stop the Kineto window: that time belongs to no step
        before = rec.cuda_event()
        t0 = time.perf_counter()
        try:
            with rec.annotate():
                batch = self._next_batch()
        except StopIteration:
            rec.after_call(track)
            raise
        track.got(t0, time.perf_counter(), batch)
        if before is not None and len(track.events) < MAX_EVENT_STEPS:
            track.events.append((len(track.steps), before, rec.cuda_event()))
        return batch

    def _next_batch(self) -> Any:
        track = self._track
        if self._replay and len(track.cache) >= self._rec.replay_batches:
            if self._length is not None and self._served >= self._length:
                raise StopIteration
            if self._inner is not None:  # stop the real loader's workers: from here on memory serves
                self._inner = None
            batch = track.cache[self._served % len(track.cache)]
        else:
            batch = next(self._inner)
            if self._replay:
                track.cache.append(batch)
        self._served += 1
        return batch


class Recorder:
    """All tracks of this process, and when to stop. One per process (``recorder()``)."""

    def __init__(self, out: Path | None, *, steps: int | None, warmup: int, replay_key: str | None = None,
                 kineto_steps: int = 0, seconds: float | None = None,
                 apply: dict[str, Any] | None = None) -> None:
        self.out, self.steps_limit, self.warmup = out, steps, warmup
        self.seconds_limit = seconds  # measured seconds, then the command is ended (None: no time budget)
        self.apply = apply or {}  # --verify-fix: {"key": training loader key, "num_workers": N, ...}
        self.applied: dict[str, Any] = {}
        self.not_applied: dict[str, str] = {}  # what --verify-fix could not change, and why
        self._batch_wraps: dict[int, Any] = {}  # id(loader) -> its iterator's wrap (the uint8 presets)
        self._apply_done = False
        self._log_fd: int | None = None
        self.replay_key, self.replay_batches = replay_key, max(1, min(warmup, 32))
        self.kineto_steps = kineto_steps
        self.tracks: dict[int, Track] = {}
        self.sampler = _samples.WorkerSampler()
        self.pid, self.rank = os.getpid(), _rank()
        self.started = time.time()
        self.ended: str | None = None
        self.written: Path | None = None
        self._kineto: Any = None
        self._kineto_track: Track | None = None
        self._kineto_result: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._cuda = False
        self.active = True

    # -- tracks ---------------------------------------------------------------------------
    def track_for(self, loader: Any, key: str | None = None) -> Track:
        with self._lock:
            track = self.tracks.get(id(loader))
            if track is None:
                track = Track(key or self._key(loader), loader, len(self.tracks))
                track.meta["iterated_at"] = _call_site()
                self.tracks[id(loader)] = track
            return track

    def _key(self, loader: Any) -> str:
        """``Kind@file:line`` of the user's ``DataLoader(...)`` line (where it is iterated when that is unknown:
        a loader made before the probe started); two loaders made on one line are told apart by where each is
        iterated, then by their order."""
        site = getattr(loader, "_fastload_created_at", None)
        iterated = _call_site()
        key = f"{type(loader).__name__}@{short_path(site) if site else iterated}"
        taken = {t.key for t in self.tracks.values()}
        if key in taken:
            key = f"{key} iterated at {iterated}"
        base, n = key, 2
        while key in taken:
            key, n = f"{base} #{n}", n + 1
        return key

    def wrap(self, loader: Any, iterator: Any, key: str | None = None) -> _TimedIter:
        try:
            length = len(loader)
        except TypeError:
            length = None
        return _TimedIter(iterator, self.track_for(loader, key), self, length)

    def training_track(self) -> Track | None:
        tracks = [t for t in self.tracks.values() if t.steps]
        return max(tracks, key=lambda t: (len(t.steps), -t.index)) if tracks else None

    def apply_to(self, loader: Any) -> None:
        """``--verify-fix``: set the recommended loader options on the training loader before it starts."""
        if self._apply_done or self.apply.get("key") != self.track_for(loader).key:
            return
        self._apply_done = True
        for name in LOADER_OPTIONS:
            if name in self.apply and hasattr(loader, name):
                value = self.apply[name]
                if name == "num_workers":
                    if value > 0 and getattr(loader, "prefetch_factor", None) is None:
                        loader.prefetch_factor = 2  # torch's default with workers; None is required with 0
                    if value == 0:
                        loader.prefetch_factor = None
                        if getattr(loader, "persistent_workers", False):
                            object.__setattr__(loader, "persistent_workers", False)
                setattr(loader, name, value)
                self.applied[name] = value
        self.track_for(loader).meta.update({k: v for k, v in self.applied.items() if k in LOADER_OPTIONS})
        if self.apply.get("uint8_presets"):
            from fastload.profiling import _uint8

            try:
                self.applied["uint8_presets"], self._batch_wraps[id(loader)] = _uint8.apply(loader)
            except _uint8.NotTranslatable as exc:
                self.not_applied["uint8_presets"] = str(exc)

    def batches(self, loader: Any, iterator: Any) -> Any:
        """``iterator`` as the user's loop gets it: wrapped where ``--verify-fix`` changed its batches."""
        wrap = self._batch_wraps.get(id(loader))
        return iterator if wrap is None else wrap(iterator)

    # -- per call -------------------------------------------------------------------------
    def annotate(self):
        if self._kineto is None:
            return _NULL
        from torch.profiler import record_function

        return record_function("fastload.data_wait")

    def before_call(self, track: Track) -> None:
        done = len(track.steps)
        if self.kineto_steps and self._kineto is None and self._kineto_result is None and done == self.warmup:
            self._start_kineto(track)
        elif self._kineto is not None and track is self._kineto_track and done >= self.warmup + self.kineto_steps:
            self._stop_kineto()
        if self.steps_limit is not None and done >= self.warmup + self.steps_limit:
            self.ended = "steps"
        elif self.seconds_limit is not None and done > self.warmup and (
                time.perf_counter() - track.steps[self.warmup][0] >= self.seconds_limit):
            self.ended = "time"
        if self.ended in ("steps", "time"):
            self.finish()
            raise SystemExit(0)

    def after_call(self, track: Track) -> None:
        self.log_step(track, track.call_started(time.perf_counter()))

    # -- the append-only steps file: what an abrupt end (os._exit, SIGKILL, OOM) leaves ----------
    def log_step(self, track: Track, step: list[float] | None) -> None:
        """Append one finished step to ``steps-rank<R>-<pid>.jsonl`` (one unbuffered write per step)."""
        if step is None or self.out is None or not self.active or os.getpid() != self.pid:
            return
        try:
            if self._log_fd is None:
                self.out.mkdir(parents=True, exist_ok=True)
                self._log_fd = os.open(self.out / f"steps-rank{self.rank}-{self.pid}.jsonl",
                                       os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)
                os.write(self._log_fd, (json.dumps({"process": self.static()}) + "\n").encode())
            line = ""
            if not track.logged:
                track.logged = True
                line = json.dumps({"track": track.index, **track.header()}) + "\n"
            os.write(self._log_fd, (line + json.dumps([track.index, *step]) + "\n").encode())
        except OSError:  # a full disk must not stop the training
            self._log_fd = self._log_fd if self._log_fd is not None else -1

    def static(self) -> dict[str, Any]:
        """The figures of this process known at start (the steps file's first line)."""
        from dataclasses import asdict

        from fastload.system import cpu_budget

        return {"rank": self.rank, "pid": self.pid, "world_size": int(os.environ.get("WORLD_SIZE", "1") or 1),
                "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1),
                "cpus": asdict(cpu_budget()), "warmup": self.warmup, "steps_limit": self.steps_limit,
                "seconds_limit": self.seconds_limit, "headspace": self.replay_key is not None,
                "applied": self.applied, "not_applied": self.not_applied}

    def cuda_event(self) -> Any:
        """A CUDA event recorded on the current stream now, or None without CUDA work in this process."""
        if not self._cuda:
            torch = sys.modules.get("torch")
            if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
                return None
            self._cuda = True
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    # -- Kineto window (CUDA only) --------------------------------------------------------
    def _start_kineto(self, track: Track) -> None:
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            self._kineto_result = {"skipped": "no CUDA work in this process"}
            return
        from torch.profiler import ProfilerActivity, profile

        self._kineto = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self._kineto.start()
        self._kineto_track = track

    def _stop_kineto(self) -> None:
        from torch.profiler import record_function

        from fastload.profiling._kineto import gpu_timeline

        prof, self._kineto = self._kineto, None
        with record_function("fastload.window_end"):
            pass
        prof.stop()
        path = (self.out or Path(".")) / f"kineto-rank{self.rank}.json"
        prof.export_chrome_trace(str(path))
        if hasattr(prof, "wait_for_exports"):  # torch's deferred (CUPTI monitor) export writes the file later
            prof.wait_for_exports()
        self._kineto_result = gpu_timeline(json.loads(path.read_text()))
        self._kineto_result["trace"] = path.name
        self._kineto_result["track"] = self._kineto_track.key if self._kineto_track else None

    # -- results --------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        cuda = None
        if "torch" in sys.modules:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                cuda = {"device": torch.cuda.get_device_name(), "count": torch.cuda.device_count()}
        training = self.training_track()
        return {
            **self.static(), "cuda": cuda, "ended": self.ended or "exit",
            "training": None if training is None else training.key,
            "tracks": [{**t.header(), "steps": t.steps, "worker_pids": sorted(t.worker_pids),
                        "event_idle": _event_idle(t)} for t in self.tracks.values()],
            "worker_cpu": self.sampler.stop(),
            "kineto": self._kineto_result,
        }

    def finish(self) -> Path | None:
        """Write the rank file once (no-op when nothing was iterated or already written)."""
        with self._lock:
            if self.written is not None or not self.active:
                return self.written
            self.active = False
        if self._kineto is not None:
            try:
                self._stop_kineto()
            except Exception as exc:  # a half-finished window must not lose the host figures
                self._kineto_result = {"skipped": f"Kineto window not completed: {exc}"}
        if not any(t.steps or t.pending for t in self.tracks.values()) or self.out is None:
            return None
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"probe-rank{self.rank}-{self.pid}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.snapshot()))
        os.replace(tmp, path)
        self.written = path
        return path


def _event_idle(track: Track) -> list[list[float]] | None:
    if not track.events:
        return None
    try:
        return track.event_idle()
    except Exception:  # CUDA already torn down at exit: the host figures still stand
        return None


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL = _Null()
_RECORDER: Recorder | None = None
_SUPPRESS = threading.local()


def recorder() -> Recorder | None:
    return _RECORDER


def start(out: Path | None, *, steps: int | None, warmup: int, replay_key: str | None = None,
          kineto_steps: int = 0, seconds: float | None = None, apply: dict[str, Any] | None = None) -> Recorder:
    """Make this process's recorder current and patch the DataLoader (idempotent)."""
    global _RECORDER
    _RECORDER = Recorder(out, steps=steps, warmup=warmup, replay_key=replay_key, kineto_steps=kineto_steps,
                         seconds=seconds, apply=apply)
    _samples.stats().reset(out)
    import multiprocessing

    # a spawned DataLoader worker runs sitecustomize too: it must keep flushing as workers do
    _samples.stats().main_pid = os.getpid() if multiprocessing.parent_process() is None else None
    if "torch.utils.data.dataloader" in sys.modules:
        _patch_dataloader()
    else:
        _on_import("torch.utils.data.dataloader", _patch_dataloader)
    if "fastload.load.loader" in sys.modules:
        _patch_thread_backend()
    else:
        _on_import("fastload.load.loader", _patch_thread_backend)
    return _RECORDER


def stop() -> Recorder | None:
    global _RECORDER
    rec, _RECORDER = _RECORDER, None
    return rec


def _patch_dataloader(*_: Any) -> None:
    from torch.utils.data import dataloader as dl

    cls = dl.DataLoader
    if getattr(cls.__iter__, "_fastload_profile", False):
        return
    original = cls.__iter__
    original_init = cls.__init__

    def __iter__(self):
        rec = _RECORDER
        if rec is None or not rec.active or getattr(_SUPPRESS, "on", False):
            return original(self)
        if rec.apply:
            rec.apply_to(self)
        _samples.prepare_loader(self, rec.out)
        return rec.wrap(self, rec.batches(self, original(self)))

    @functools.wraps(original_init)  # inspect.signature(DataLoader) stays torch's
    def __init__(self, *args, **kwargs):
        workers = kwargs.get("num_workers", args[5] if len(args) > 5 else 0)
        if isinstance(workers, str):
            message = check_num_workers(type(self), workers)
            rec = _RECORDER
            if rec is not None and rec.out is not None:  # `fastload profile` names it after the command ends
                try:
                    rec.out.mkdir(parents=True, exist_ok=True)
                    (rec.out / f"failure-rank{rec.rank}-{os.getpid()}.txt").write_text(message)
                except OSError:
                    pass
            raise TypeError(message)
        if "_fastload_created_at" not in self.__dict__:  # a subclass's __init__ calling ours: the outer call named it
            site = _construction_site(self, 2)
            if site is not None:
                self.__dict__["_fastload_created_at"] = site
        original_init(self, *args, **kwargs)

    __iter__._fastload_profile = True  # type: ignore[attr-defined]
    __iter__._fastload_original = original  # type: ignore[attr-defined]
    __init__._fastload_original = original_init  # type: ignore[attr-defined]
    cls.__iter__ = __iter__
    cls.__init__ = __init__


def _patch_thread_backend(*_: Any) -> None:
    """``fastload.DataLoader(backend="threads")`` makes its iterator without torch's ``__iter__``: time it here."""
    from fastload.load import loader as fl

    cls = fl.DataLoader
    if getattr(cls.__iter__, "_fastload_profile", False):
        return
    original = cls.__iter__

    def __iter__(self):
        rec = _RECORDER
        if (getattr(self, "backend", None) != "threads" or rec is None or not rec.active
                or getattr(_SUPPRESS, "on", False)):
            return original(self)  # the processes backend reaches torch's (patched) __iter__
        if rec.apply:
            rec.apply_to(self)
        _samples.prepare_loader(self, rec.out)
        return rec.wrap(self, rec.batches(self, original(self)))

    functools.update_wrapper(__iter__, original)
    __iter__._fastload_profile = True  # type: ignore[attr-defined]
    __iter__._fastload_original = original  # type: ignore[attr-defined]
    cls.__iter__ = __iter__


def check_num_workers(cls: type, value: str) -> str:
    """The message for ``num_workers="auto"`` (any string) given to torch's own DataLoader."""
    return (f"{cls.__module__}.{cls.__qualname__}(num_workers={value!r}): torch's DataLoader takes an int; "
            "num_workers=\"auto\" is fastload's.\nHINT: from fastload import DataLoader (same signature, "
            "num_workers=\"auto\" picks the count for this machine), or pass an int")


class _PostImport:
    """A meta-path hook that calls ``fn`` once module ``name`` has been executed (patch torch lazily)."""

    def __init__(self, name: str, fn) -> None:
        self.name, self.fn = name, fn

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        import importlib.util

        sys.meta_path.remove(self)  # once, and so that the lookup below finds the real module
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, fn = spec.loader, self.fn
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            fn(module)

        loader.exec_module = exec_and_patch
        return spec


def _on_import(name: str, fn) -> None:
    sys.meta_path.insert(0, _PostImport(name, fn))


def install_from_env() -> Recorder | None:
    """What ``sitecustomize`` calls: a recorder configured by ``FASTLOAD_PROFILE_*``, results written at exit."""
    out = os.environ.get(ENV_OUT)
    if not out:
        return None
    steps = os.environ.get(ENV_STEPS)
    seconds = os.environ.get(ENV_BUDGET)
    rec = start(Path(out), steps=int(steps) if steps else None, warmup=int(os.environ.get(ENV_WARMUP, "5")),
                replay_key=os.environ.get(ENV_REPLAY) or None, kineto_steps=int(os.environ.get(ENV_KINETO, "0")),
                seconds=float(seconds) if seconds else None,
                apply=json.loads(os.environ[ENV_APPLY]) if os.environ.get(ENV_APPLY) else None)
    atexit.register(_at_exit)
    previous_hook = sys.excepthook

    def excepthook(kind, value, tb):  # the script died of an exception (Ctrl-C included): say which
        if rec.ended is None:
            rec.ended = kind.__name__
        previous_hook(kind, value, tb)

    sys.excepthook = excepthook
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
    return rec


def _on_sigterm(signum, frame):
    rec = _RECORDER
    if rec is not None and rec.pid == os.getpid():
        rec.ended = "SIGTERM"
        raise SystemExit(128 + signum)
    signal.signal(signum, signal.SIG_DFL)  # a forked child that inherited the handler: die as usual
    os.kill(os.getpid(), signum)


def _at_exit() -> None:
    rec = _RECORDER
    if rec is None or rec.pid != os.getpid():
        return
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the file in half
    except ValueError:
        pass
    rec.finish()
    _samples.stats().flush()
