"""The loader each A/B stage runs, built in one place for recipes and ``bench loader``.

Owns: one builder per stage type (``baseline``, ``workers``, ``lmdb``, ``fast``,
``threads``, ``threads-autotune``, ``dali-cpu``, ``dali-gpu``), the torchvision baseline
transform, the reason a stage cannot run here, the optional per-file read delay, and shutting
a stage's loader down so the next stage is timed on an idle machine with the process's torch threads as they were.

The output contract, the same for every stage: batches of ``float32`` NCHW images
normalised with the ImageNet mean/std, and ``int64`` labels, on the run's device. Each
stage pays for getting there inside the timed loop:

* ``baseline`` / ``workers`` / ``lmdb``: torchvision ``ToTensor`` + ``Normalize`` in the
  loader (the main process for 0 workers, else the workers), then a move to the device;
* ``fast`` / ``threads``: ``uint8`` batches from worker processes / from a pool of threads
  of the training process (``backend="threads"``), converted and normalised by
  ``DevicePrefetcher`` — on the GPU when the device is CUDA, and on the CPU, in the main
  process, on its helper thread while the step runs on the batch before (with
  ``prefetch_ahead=False``: inside the measured ``next(loader)``) when it is not
  (``threads-autotune``: the thread pool sizing itself while it runs, ``load/autotune.py``)
  (so a CPU-only table charges ``fast`` the main process's CPU for the normalisation the
  others do in their workers);
* ``dali-cpu`` / ``dali-gpu``: DALI's own normalise, in its CPU threads or on the GPU.

Every stage's loader goes through ``DevicePrefetcher`` (float images are only moved and
given the memory format), so no stage gets a different hand-off to the step.

With ``StageOptions(uint8=True)`` the contract is a GPU host's instead: ``uint8`` NCHW images
(0..255, cropped, resized and flipped, not normalised: that is left to the device) and ``int64``
labels. torchvision ends in ``PILToTensor`` instead of ``ToTensor`` + ``Normalize``, ``fast`` /
``threads`` hand their ``uint8`` batches on as they are, DALI's ``crop_mirror_normalize``
writes ``uint8`` without normalising; every stage's batches are only moved to the device (and
made contiguous in the asked memory format where they are not).

Adding a stage is one function registered with ``@_stage("name")`` that returns a
``BuiltStage``; ``STAGE_TYPES`` (what recipes accept) follows the registry.

Must not: time anything (``train.py``), or print.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastload.errors import FastloadError
from fastload.image import DEFAULT_SIZE

__all__ = ["STAGE_TYPES", "StageData", "StageOptions", "BuiltStage", "build_stage", "skip_reason", "running",
           "shutdown", "torchvision_train_transform", "Uint8Batches", "autotune_state"]


@dataclass(frozen=True)
class StageData:
    """The same data in the two forms stages read: the image folder (None: only a store) and the store."""

    folder: Path | None
    store: Path


@dataclass(frozen=True, kw_only=True)
class StageOptions:
    """What every stage shares.

    Args:
        batch_size, image_size: images per batch; side of the random-resized crop.
        workers: loader worker processes (DALI: CPU threads); None: the type's default
            (0 for ``baseline``, ``"auto"`` for the others).
        prefetch_factor: batches each worker keeps ready (None: torch's default).
        device: where batches are handed out (``"cpu"``, ``"cuda"``, a ``torch.device``).
        seed: shuffling seed where the loader takes one.
        channels_last: hand out ``torch.channels_last`` images (fastload's presets write them so on
            the CPU, ``channels_last=True``; the other stages convert their batches).
        pin_memory: None: pinned when the device is CUDA (``baseline`` never pins).
        read_delay_ms: emulated latency of opening a file (a network file system); see
            ``FileOpenDelay``. DALI stages cannot apply it and are skipped when it is set.
        uint8: hand out ``uint8`` NCHW images, not normalised (the module docstring's second
            contract), instead of normalised ``float32``.
        prefetch_ahead: ``DevicePrefetcher(ahead=...)``: convert the next batch while the step runs
            (CPU: on a helper thread; CUDA: on a side stream), else when the step asks for it.
    """

    batch_size: int
    image_size: int = DEFAULT_SIZE
    workers: int | str | None = None
    prefetch_factor: int | None = None
    device: Any = "cpu"
    seed: int = 0
    channels_last: bool = False
    pin_memory: bool | None = None
    read_delay_ms: float = 0.0
    uint8: bool = False
    prefetch_ahead: bool = True

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.image_size < 8:
            raise ValueError(f"batch_size >= 1 and image_size >= 8 are required, got {self.batch_size}, "
                             f"{self.image_size}")
        if self.workers is not None and self.workers != "auto" and (isinstance(self.workers, bool) or
                                                                    not isinstance(self.workers, int) or
                                                                    self.workers < 0):
            raise ValueError(f"workers must be 'auto', None or an integer >= 0, got {self.workers!r}")
        if self.read_delay_ms < 0:
            raise ValueError(f"read_delay_ms must be >= 0, got {self.read_delay_ms}")

    def resolved_workers(self, default: int | str) -> int:
        from fastload.load.workers import auto_num_workers

        w = self.workers if self.workers is not None else default
        return auto_num_workers() if w == "auto" else int(w)


@dataclass
class BuiltStage:
    """A stage ready to iterate: the loader (the output contract above) and the workers it uses."""

    type: str
    loader: Iterable
    workers: int
    normalises: str  # where the uint8 → normalised float conversion happens, for the table


_BUILDERS: dict[str, Callable[[StageData, StageOptions], BuiltStage]] = {}


def _stage(name: str):
    def register(fn: Callable[[StageData, StageOptions], BuiltStage]):
        _BUILDERS[name] = fn
        return fn
    return register


def torchvision_train_transform(size: int, *, uint8: bool = False):
    """The standard torchvision training pipeline: the baseline everybody starts from (``uint8``:
    ending in ``PILToTensor``, a ``uint8`` CHW tensor, instead of ``ToTensor`` + ``Normalize``)."""
    import torchvision.transforms as T

    from fastload.load.transforms import IMAGENET_MEAN, IMAGENET_STD

    if uint8:
        return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.PILToTensor()])
    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(),
                      T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


def _tv_normalises(o: StageOptions, where: str) -> str:
    return f"{where} (torchvision PILToTensor, uint8)" if o.uint8 else f"{where} (torchvision ToTensor + Normalize)"


class Uint8Batches:
    """``uint8`` batches moved to ``device`` as they are (``StageOptions(uint8=True)``): images
    contiguous NCHW (or channels-last), labels ``int64``. The uint8 contract's ``DevicePrefetcher``."""

    def __init__(self, loader: Iterable, device: Any, *, channels_last: bool = False) -> None:
        import torch

        self.loader, self.device, self.channels_last = loader, torch.device(device), channels_last

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self):
        import torch

        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        cuda = self.device.type == "cuda"
        for images, labels, *_ in self.loader:
            images = images.to(self.device, non_blocking=cuda).contiguous(memory_format=fmt)
            yield images, torch.as_tensor(labels).to(self.device, dtype=torch.int64, non_blocking=cuda)


class FileOpenDelay:
    """A dataset wrapper charging ``delay_ms`` for every file the reader opens.

    The same rule for both readers, which is what a network file system charges (a
    metadata round trip per open): a folder dataset opens one file per sample, so every
    sample pays; a store is one file, opened once per process, so its first sample in
    each process pays. Picklable, so each worker process applies it itself.
    """

    def __init__(self, dataset, delay_ms: float, *, one_file: bool) -> None:
        self.dataset, self.delay_s, self.one_file = dataset, delay_ms / 1e3, one_file
        self._opened_in: int | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        if not self.one_file or self._opened_in != os.getpid():
            self._opened_in = os.getpid()
            time.sleep(self.delay_s)
        return self.dataset[index]


def _delayed(dataset, o: StageOptions, *, one_file: bool):
    return FileOpenDelay(dataset, o.read_delay_ms, one_file=one_file) if o.read_delay_ms > 0 else dataset


def _torch_loader(dataset, o: StageOptions, workers: int, *, pin: bool, fastload_loader: bool, collate=None,
                  backend: str = "processes", autotune: bool = False):
    import torch.distributed as dist
    import torch.utils.data

    from fastload.load.loader import DataLoader

    kwargs: dict[str, Any] = dict(batch_size=o.batch_size, num_workers=workers, pin_memory=pin, drop_last=True,
                                  persistent_workers=workers > 0)
    if workers > 0 and o.prefetch_factor:
        kwargs["prefetch_factor"] = o.prefetch_factor
    if collate is not None:
        kwargs["collate_fn"] = collate
    generator = torch.Generator().manual_seed(o.seed)
    if fastload_loader:
        return DataLoader(dataset, shuffle=True, generator=generator, backend=backend, autotune=autotune, **kwargs)
    sampler = None
    if dist.is_available() and dist.is_initialized():  # give torch's loader the same sharding, fairly
        sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True, seed=o.seed, drop_last=True)
    return torch.utils.data.DataLoader(dataset, shuffle=sampler is None, sampler=sampler,
                                       generator=None if sampler else generator, **kwargs)


def _to_device(loader: Iterable, o: StageOptions):
    """The same hand-off for every stage: ``DevicePrefetcher`` to the device, float32 (``uint8``:
    ``Uint8Batches``, moved as they are)."""
    import torch

    from fastload.load.prefetch import DevicePrefetcher

    if o.uint8:
        return Uint8Batches(loader, o.device, channels_last=o.channels_last)
    return DevicePrefetcher(loader, o.device, dtype=torch.float32, channels_last=o.channels_last,
                            ahead=o.prefetch_ahead)


def _fast_normalises(o: StageOptions) -> str:
    import torch

    if o.uint8:
        return "not normalised (uint8 batches)"
    if torch.device(o.device).type == "cuda":
        return "GPU (DevicePrefetcher)"
    if o.prefetch_ahead:
        return "main process, a helper thread one batch ahead, during the step (DevicePrefetcher on CPU)"
    return "main process, in the training thread when the step asks (DevicePrefetcher on CPU, ahead=False)"


def _pin(o: StageOptions) -> bool:
    import torch

    return o.pin_memory if o.pin_memory is not None else torch.device(o.device).type == "cuda"


def _folder(data: StageData) -> Path:
    if data.folder is None:
        raise FastloadError("this stage reads the image folder, and the recipe has only a store")
    return data.folder


@_stage("baseline")
def _baseline(data: StageData, o: StageOptions) -> BuiltStage:
    from torchvision.datasets import ImageFolder

    workers = o.resolved_workers(0)
    tv = torchvision_train_transform(o.image_size, uint8=o.uint8)
    ds = _delayed(ImageFolder(str(_folder(data)), transform=tv), o, one_file=False)
    loader = _torch_loader(ds, o, workers, pin=False, fastload_loader=False)
    return BuiltStage("baseline", _to_device(loader, o), workers, _tv_normalises(o, "loader"))


@_stage("workers")
def _workers(data: StageData, o: StageOptions) -> BuiltStage:
    from torchvision.datasets import ImageFolder

    workers = o.resolved_workers("auto")
    tv = torchvision_train_transform(o.image_size, uint8=o.uint8)
    ds = _delayed(ImageFolder(str(_folder(data)), transform=tv), o, one_file=False)
    loader = _torch_loader(ds, o, workers, pin=_pin(o), fastload_loader=False)
    return BuiltStage("workers", _to_device(loader, o), workers, _tv_normalises(o, "workers"))


@_stage("lmdb")
def _lmdb(data: StageData, o: StageOptions) -> BuiltStage:
    from fastload.load.dataset import LMDBImageDataset

    workers = o.resolved_workers("auto")
    tv = torchvision_train_transform(o.image_size, uint8=o.uint8)
    ds = _delayed(LMDBImageDataset(data.store, transform=tv), o, one_file=True)
    loader = _torch_loader(ds, o, workers, pin=_pin(o), fastload_loader=True)
    return BuiltStage("lmdb", _to_device(loader, o), workers, _tv_normalises(o, "workers"))


@_stage("fast")
def _fast(data: StageData, o: StageOptions) -> BuiltStage:
    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.transforms import collate_uint8, train_transform

    workers = o.resolved_workers("auto")
    preset = train_transform(o.image_size, channels_last=o.channels_last)
    ds = _delayed(LMDBImageDataset(data.store, transform=preset), o, one_file=True)
    loader = _torch_loader(ds, o, workers, pin=_pin(o), fastload_loader=True, collate=collate_uint8)
    return BuiltStage("fast", _to_device(loader, o), workers, _fast_normalises(o))


def _thread_stage(name: str, data: StageData, o: StageOptions, *, autotune: bool) -> BuiltStage:
    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.transforms import collate_uint8, train_transform

    threads = o.resolved_workers("auto") or 1
    preset = train_transform(o.image_size, channels_last=o.channels_last)
    ds = _delayed(LMDBImageDataset(data.store, transform=preset), o, one_file=True)
    loader = _torch_loader(ds, o, threads, pin=_pin(o), fastload_loader=True, collate=collate_uint8,
                           backend="threads", autotune=autotune)
    return BuiltStage(name, _to_device(loader, o), threads, _fast_normalises(o))


@_stage("threads")
def _threads(data: StageData, o: StageOptions) -> BuiltStage:
    """``fast`` with the worker-free thread pipeline: the same presets, no worker processes."""
    return _thread_stage("threads", data, o, autotune=False)


@_stage("threads-autotune")
def _threads_autotune(data: StageData, o: StageOptions) -> BuiltStage:
    """``threads`` sizing itself while it runs (``load/autotune.py``): ``workers`` is where it starts."""
    return _thread_stage("threads-autotune", data, o, autotune=True)


def _dali(data: StageData, o: StageOptions, mode: str) -> BuiltStage:
    import torch

    from fastload.load.dali import DALILoader, DALIOptions

    threads = o.resolved_workers("auto") or 1
    loader = DALILoader(data.store, o.batch_size, train=True, size=o.image_size, device=mode, num_threads=threads,
                        seed=o.seed, drop_last=True,
                        options=DALIOptions(dtype=torch.uint8 if o.uint8 else torch.float32,
                                            channels_last=o.channels_last))  # HWC from the pipeline, no transpose
    where = "DALI on the GPU" if mode == "gpu" else "DALI CPU threads"
    if o.uint8:
        where += " (uint8, not normalised)"
    return BuiltStage(f"dali-{mode}", _to_device(loader, o), threads, where)


@_stage("dali-cpu")
def _dali_cpu(data: StageData, o: StageOptions) -> BuiltStage:
    return _dali(data, o, "cpu")


@_stage("dali-gpu")
def _dali_gpu(data: StageData, o: StageOptions) -> BuiltStage:
    return _dali(data, o, "gpu")


def autotune_state(loader: Any) -> dict | None:
    """Where a self-sizing stage's tuner is now (``threads-autotune``): ``{"threads", "depth", "changes",
    "decisions"}`` (changes: decisions other than holding), or None for a stage with no tuner."""
    for inner in _torch_loaders(loader):
        tuner = getattr(inner, "autotuner", None)
        if tuner is not None:
            return {"threads": tuner.threads, "depth": tuner.depth, "decisions": len(tuner.decisions),
                    "changes": sum(d.action != "hold" for d in tuner.decisions)}
    return None


STAGE_TYPES: tuple[str, ...] = tuple(_BUILDERS)
FOLDER_STAGES = frozenset({"baseline", "workers"})


def skip_reason(stage_type: str, data: StageData | None, o: StageOptions) -> str | None:
    """Why a stage of ``stage_type`` cannot run here with ``o``, or None."""
    import torch

    from fastload.system import DALI_INSTALL_HINT, dali_available

    if stage_type.startswith("dali"):
        if not dali_available():
            return "DALI is not installed: " + DALI_INSTALL_HINT
        device = torch.device(o.device)
        if stage_type == "dali-gpu" and device.type != "cuda":
            return "needs a CUDA GPU; this run's device is " + device.type
        if o.read_delay_ms > 0:
            return "read_delay_ms cannot be applied inside DALI's reader, so it would not read the same way"
    if stage_type in FOLDER_STAGES and data is not None and data.folder is None:
        return "reads the image folder, and this run has only a store"
    return None


def build_stage(stage_type: str, data: StageData, options: StageOptions) -> BuiltStage:
    """The loader of one stage (see the module docstring for its output contract).

    Raises:
        ValueError: an unknown stage type (the message lists the valid ones).
    """
    builder = _BUILDERS.get(stage_type)
    if builder is None:
        raise ValueError(f"Unknown stage type {stage_type!r}. Valid values are {', '.join(STAGE_TYPES)}.")
    return builder(data, options)


def _torch_loaders(loader: Any, depth: int = 0) -> Iterable[Any]:
    """The loader and every loader it wraps (``DevicePrefetcher.loader``, the stages of a
    WebDataset ``WebLoader``'s ``pipeline``)."""
    if loader is None or depth > 4:
        return
    yield loader
    inner = getattr(loader, "loader", None) or getattr(loader, "dataloader", None)
    yield from _torch_loaders(inner, depth + 1)
    pipeline = getattr(loader, "pipeline", None)
    if isinstance(pipeline, list):
        for stage in pipeline:
            yield from _torch_loaders(stage, depth + 1)


def shutdown(loader: Any) -> None:
    """Stop a loader's worker processes / pipeline now and wait for them, not at garbage collection."""
    for inner in _torch_loaders(loader):
        it = getattr(inner, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()  # joins the workers: none is left refilling a queue
            inner._iterator = None
        close = getattr(inner, "close", None)
        if callable(close):
            close()


class running:
    """``with running(built) as loader:`` — on exit the workers are shut down and joined, and
    torch's intra-op thread count is put back, so the next stage starts on an idle machine
    with the threads this one found (``fastload.DataLoader`` lowers them while it iterates)."""

    def __init__(self, built: BuiltStage) -> None:
        self.built = built

    def __enter__(self) -> Iterable:
        import torch

        self._threads = torch.get_num_threads()
        return self.built.loader

    def __exit__(self, *exc: object) -> None:
        import torch

        try:
            shutdown(self.built.loader)
        finally:
            torch.set_num_threads(self._threads)
