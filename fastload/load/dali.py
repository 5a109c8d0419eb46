"""``DALILoader``: NVIDIA DALI pipelines with the same batch contract as the DataLoader path.

Owns: building the DALI graph (train: decode + random-resized crop + flip + normalise;
eval: decode + resize shorter side + center crop + normalise) on the GPU (``device="mixed"``
nvJPEG decode, hardware decoder where the GPU has one) or the CPU (``device_id=None``),
feeding it from a store (parallel ``external_source``, global per-epoch shuffle) or an
ImageFolder tree (``fn.readers.file``), sharding under ``torch.distributed``, and turning
DALI's failures into errors that name the sample.

Batches are ``(images, labels)``: images float NCHW normalised (ImageNet mean/std unless
told), labels ``int64`` 1-D, on the GPU in GPU mode and on the CPU in CPU mode — what
``fastload.DataLoader`` + ``DevicePrefetcher`` give (``DALIOptions(dtype=torch.uint8)``: images
``uint8`` NCHW, not normalised, what ``fastload.DataLoader`` with ``collate_uint8`` gives).

Training crops use ``fn.decoders.image_random_crop``: the decoder draws the crop
(``random_area`` / ``random_aspect_ratio``, RandomResizedCrop's parameters) and decodes only
that region (nvJPEG on the GPU, libjpeg-turbo on the CPU), then ``fn.resize`` brings it to
``size``; this is the same augmentation as ``fn.random_resized_crop`` after a full decode,
without decoding pixels that are thrown away.

Shuffling: from a store, a global permutation per epoch (``_dali_source``), or, for a store
in object storage (and a local folder of shards with ``DALIOptions(order="shards")``), the
``ShardSampler``'s order: each rank reads its own run of whole shards, ``window`` shards
shuffled together, so a node downloads each shard once per epoch and its cache needs room
for a few shards per rank, not the store; the next window's shards are downloaded in the
background (from this process, into the node cache the workers read) while the current
window is read. Never DALI's reader buffer (``random_shuffle`` shuffles within
``initial_fill`` samples, 1024 by default, which measurably costs accuracy on class-sorted
data). From a folder, the file list is
permuted once by ``seed`` and the reader reshuffles the whole list after every epoch
(``shuffle_after_epoch``).

Distributed (an initialised ``torch.distributed`` group, or ``shard_id``/``num_shards``):
every rank gets ``ceil(n / world)`` samples, the shortfall padded by wrapping around the
epoch's order as ``DistributedSampler`` does, so all ranks run the same number of batches.

DALI is imported inside functions: ``import fastload`` works without it; constructing a
loader without it raises ``MissingDependencyError`` with the pip command.

Forked children: a DALI pipeline that is garbage in the parent (in a reference cycle not yet
collected) must never be destroyed in a child forked from it: its ``__del__`` waits for
threads that exist only in the parent, and a child whose collector reaches it (torch's
DataLoader workers, fork-started, collect garbage like any process) hangs for good; seen
as a whole test run stuck in a 2-worker DataLoader after the DALI tests. So importing this
module makes every forked child ``gc.freeze()`` what it inherited: the child then never
collects the parent's objects (they stay shared, copy-on-write, which also saves memory);
its own objects are collected as usual. ``tests/load/test_dali.py`` forks a child that
collects such a pipeline.

Must not: be imported by ``fastload/__init__`` eagerly.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from fastload.errors import CorruptSampleError, MissingDependencyError, ResumeStateError, WorkerStartError
from fastload.image import DEFAULT_RESIZE, DEFAULT_SIZE
from fastload.load import state as _state
from fastload.load._shard_order import DEFAULT_WINDOW, ShardOrder
from fastload.load.skips import check_on_error, record_skip
from fastload.load.tracker import DALITracker
from fastload.load.transforms import IMAGENET_MEAN, IMAGENET_STD
from fastload.system import DALI_INSTALL_HINT, dali_available, resolve_device

__all__ = ["DALILoader", "DALIOptions", "dali_available"]


os.register_at_fork(after_in_child=gc.freeze)  # see "Forked children" above

# The DALI ResNet-50 example's pre-allocation hints for nvJPEG: they avoid reallocations
# (and the stalls they cause) during the first epochs on ImageNet-sized images.
_DEVICE_MEMORY_PADDING = 211_025_920
_HOST_MEMORY_PADDING = 140_544_512
_PREALLOCATE_WIDTH_HINT = 5_980
_PREALLOCATE_HEIGHT_HINT = 6_430


_GUARD_HINT = (
    "DALI's worker processes could not start. DALILoader reads a store with a parallel external_source, "
    "whose workers are started with 'spawn': each re-imports your script, so a script that builds a "
    "DALILoader at module level starts it again in every worker.\nHINT: put the code that builds and runs the "
    "loader under `if __name__ == \"__main__\":` (as PyTorch's DataLoader docs ask for num_workers > 0).")


def _require_dali():
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        raise MissingDependencyError(f"DALI is not installed.\nHINT: {DALI_INSTALL_HINT}") from None


def _refuse_during_spawn_bootstrap() -> None:
    """In a spawned child that is still importing the parent's ``__main__``, say why instead of failing deep inside."""
    import multiprocessing.process

    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        raise WorkerStartError(_GUARD_HINT)


def _is_store(path: Path) -> bool:
    from fastload.store import format as fmt

    return fmt.is_store_dir(path) or bool(fmt.find_shards(path))


@dataclass(frozen=True, kw_only=True)
class DALIOptions:
    """The less common settings of a ``DALILoader``.

    Args:
        resize: the shorter side before the eval center crop.
        py_workers: processes for the store callback (reading bytes; cheap).
        mean, std: normalisation, on the 0..1 scale.
        dtype: dtype of the images handed out: a float dtype (normalised by ``mean``/``std``), or
            ``torch.uint8``: 0..255, cropped, resized and flipped but not normalised (``mean`` and
            ``std`` unused; normalise on the device, as ``DevicePrefetcher`` does a uint8 batch).
            ``channels_last``: their memory format.
        shard_id, num_shards: default from ``torch.distributed`` when initialised, else 0, 1.
        device_id: the GPU (default: the current CUDA device).
        hw_decoder_load: share of JPEG decoding sent to the GPU's hardware decoder (A100,
            H100/H200 have one; ignored elsewhere and on the CPU).
        prefetch_queue_depth: batches DALI prepares ahead.
        cache_dir, cache_limit: a store in object storage: the node's shard cache and the bytes it
            may hold (as ``LMDBImageDataset``'s). Read by shards (the default for such a store), a
            rank holds about ``2 * window + 1`` shards (the window and the next one, prefetched;
            each DALI worker keeps ``window + 1`` open): give the cache room for that per rank on
            the node (and per ``py_workers`` beyond the first, ``window + 1`` more). With
            ``order="global"`` every shard is needed all epoch: room for the store.
        order: ``"auto"`` (default): by shards (``ShardSampler``'s order) for a store in object
            storage, one global permutation for a local store; ``"shards"``: by shards, also for a
            local store (a folder of shards on NFS or local disks); ``"global"``: one global
            permutation, also for a store in object storage (the order of the local copy).
        window: shards whose samples are shuffled together when reading by shards.
    """

    resize: int = DEFAULT_RESIZE
    py_workers: int = 1
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    dtype: torch.dtype = torch.float32
    channels_last: bool = False
    shard_id: int | None = None
    num_shards: int | None = None
    device_id: int | None = None
    hw_decoder_load: float = 0.65
    prefetch_queue_depth: int = 2
    cache_dir: str | os.PathLike[str] | None = None
    cache_limit: int | str | None = None
    order: str = "auto"
    window: int = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        if self.order not in ("auto", "shards", "global"):
            raise ValueError(f"Unknown value {self.order!r} for argument order. Valid values are 'auto', 'shards', "
                             "'global'.")
        if not (isinstance(self.window, int) and self.window >= 1):
            raise ValueError(f"Unknown value {self.window!r} for argument window. Valid values are integers >= 1.")
        if self.py_workers < 1 or self.prefetch_queue_depth < 1 or self.resize < 1:
            raise ValueError("py_workers, prefetch_queue_depth and resize must be >= 1")
        if not 0.0 <= self.hw_decoder_load <= 1.0:
            raise ValueError(f"hw_decoder_load must be in 0..1, got {self.hw_decoder_load}")
        if not (self.dtype.is_floating_point or self.dtype == torch.uint8):
            raise ValueError(f"dtype must be a floating type or torch.uint8, got {self.dtype}")
        object.__setattr__(self, "mean", tuple(self.mean))
        object.__setattr__(self, "std", tuple(self.std))


class DALILoader:
    """Batches from a DALI pipeline over a store or an ImageFolder tree.

    Args:
        source: a store written by ``fastload convert`` (or a shard directory), an
            ImageFolder tree, or the URL of a sharded store in object storage (``s3://...``):
            read through the node's shard cache (``options.cache_dir``/``cache_limit``) shard by
            shard (``DALIOptions.order``): the same batches as from the local copy of the store
            read with ``order="shards"``.
        batch_size: samples per batch.
        train: random-resized crop + flip (True) or resize + center crop (False).
        size: output side.
        device: ``"auto"`` (GPU when one is visible, else CPU), ``"gpu"`` or ``"cpu"``.
        num_threads: DALI CPU threads; ``"auto"`` = ``auto_num_workers()`` (at least 1).
        seed: drives the epoch shuffle (same on every rank) and augmentation (+ rank).
        shuffle: default ``train``.
        drop_last: drop each epoch's partial last batch instead of returning it.
        on_error: ``"raise"`` (default): a sample that fails (checksum or decode) raises
            ``CorruptSampleError`` naming the store index and relative path. ``"skip"``
            (stores only): the sample is replaced by the next good one, the batch keeps its
            shape and the epoch completes; ``skipped`` counts them; more than 20 failures
            in a row raise ``TooManyCorruptSamplesError``. (DALI cannot skip inside a
            pipeline, NVIDIA/DALI#3913: on a failure the pipeline is rebuilt at the same
            batch with the bad sample replaced; augmentation draws restart from the seed.)
        return_index: also yield each sample's store index (folder source: its label), as a
            third element, for checks and debugging.
        options: ``DALIOptions`` for everything else.

    Raises:
        MissingDependencyError: DALI is not installed.
        WorkerStartError: DALI's worker processes could not start (most often: the script
            has no ``if __name__ == "__main__":`` guard; the message says so).
        CorruptSampleError: (when iterating) a sample failed; names the store index and
            relative path (or the file).
    """

    def __init__(self, source: str | os.PathLike[str], batch_size: int, *, train: bool = True, size: int = DEFAULT_SIZE,
                 device: str = "auto", num_threads: int | str = "auto", seed: int = 0, shuffle: bool | None = None,
                 drop_last: bool = False, on_error: str = "raise", return_index: bool = False,
                 options: DALIOptions | None = None) -> None:
        _require_dali()
        _refuse_during_spawn_bootstrap()
        opt = options or DALIOptions()
        if device not in ("auto", "gpu", "cpu"):
            raise ValueError(f"Unknown value {device!r} for argument device. Valid values are 'auto', 'gpu', 'cpu'.")
        check_on_error(on_error)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        device = {"cuda": "gpu"}.get(resolve_device("cuda" if device == "gpu" else device, what="device").type, "cpu")
        if num_threads == "auto":
            from fastload.load.workers import auto_num_workers

            num_threads = max(1, auto_num_workers())
        from fastload.store.readers import ReaderOptions, is_store_url, open_store_reader

        url = is_store_url(str(source))
        self.source = str(source).rstrip("/") + "/" if url else Path(source)
        self.batch_size, self.train, self.size = batch_size, train, size
        self.device, self.num_threads = device, int(num_threads)
        self.seed = seed
        self.shuffle = train if shuffle is None else shuffle
        self.drop_last = drop_last
        self.on_error = on_error
        self.return_index = return_index
        self.options = opt
        import torch.distributed as dist

        shard_id, num_shards = opt.shard_id, opt.num_shards
        if shard_id is None or num_shards is None:
            if dist.is_available() and dist.is_initialized():
                shard_id, num_shards = dist.get_rank(), dist.get_world_size()
            else:
                shard_id, num_shards = 0, 1
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"need 0 <= shard_id < num_shards, got {shard_id}, {num_shards}")
        self.shard_id, self.num_shards = shard_id, num_shards
        self.device_id = (opt.device_id if opt.device_id is not None else torch.cuda.current_device()) \
            if device == "gpu" else None
        self.from_store = url or _is_store(self.source)
        if on_error == "skip" and not self.from_store:
            raise ValueError("on_error='skip' needs a store (DALI's file reader cannot replace a file); pack the "
                             "folder with `fastload convert` first, it skips and reports bad files.")
        if opt.order == "shards" and not self.from_store:
            raise ValueError(f"{source}: order='shards' needs a store (a folder of shards, or a URL); an image "
                             "folder is read by DALI's file reader.\nHINT: pack it with `fastload convert "
                             "--num-shards` first, or use order='auto'.")
        self.by_shards = False
        if self.from_store:
            from fastload.load._dali_source import StoreSource

            # DALI's spawned workers unpickle the reader (a URL's leases shards from the same node cache); by
            # shards, a worker keeps the window's shards (and the one it turns to) leased, no more
            self._reader = open_store_reader(self.source, ReaderOptions(
                cache_dir=opt.cache_dir, cache_limit=opt.cache_limit,
                open_shards=opt.window + 1 if opt.order in ("shards", "auto") else 5))
            self.by_shards = opt.order == "shards" or (opt.order == "auto" and self._reader.shard_ordered)
            shards = None
            if self.by_shards:
                sizes = self._reader.shard_sizes
                shards = ShardOrder(sizes, num_replicas=num_shards, rank=shard_id, shuffle=self.shuffle, seed=seed,
                                    window=opt.window)
            self._src = StoreSource(self._reader, batch_size, shuffle=self.shuffle, seed=seed, rank=shard_id,
                                    world=num_shards, drop_last=drop_last, shards=shards)
            self.samples_per_epoch = self._src.epoch_samples
        else:
            self._files, self._labels = self._file_list()
            per_rank = len(self._files) // num_shards
            self.samples_per_epoch = per_rank // batch_size * batch_size if drop_last else per_rank
        self._pipe = None
        self._iter = None
        self._partial = False  # the current pipeline started mid-epoch (after a skip): rebuild next epoch
        self.epoch = 0
        self._tracker = DALITracker()  # the position and a loaded state (the resume seam, tracker.py)
        self.skipped = 0
        self.time_to_first_batch: float | None = None  #: seconds from ``iter()`` to the latest epoch's first batch

    # ---- building -------------------------------------------------------------------------

    def _file_list(self) -> tuple[list[str], list[int]]:
        """The tree's files in torchvision order, permuted once by seed, padded to a multiple of the shards."""
        import numpy as np

        from fastload.pack.sources import image_folder

        src = image_folder(self.source)
        files = [src.abspath(rel) for rel, _ in src.items]
        labels = [label for _, label in src.items]
        order = np.random.default_rng([self.seed, 0]).permutation(len(files)) if self.shuffle \
            else np.arange(len(files))
        total = math.ceil(len(files) / self.num_shards) * self.num_shards
        order = np.concatenate([order, order[: total - len(files)]])
        return [files[i] for i in order], [labels[i] for i in order]

    def _build(self):
        from nvidia.dali import fn, pipeline_def, types

        mixed = self.device == "gpu"
        decoder_device = "mixed" if mixed else "cpu"
        gpu_kw = dict(device_memory_padding=_DEVICE_MEMORY_PADDING, host_memory_padding=_HOST_MEMORY_PADDING,
                      hw_decoder_load=self.options.hw_decoder_load) if mixed else {}

        @pipeline_def(batch_size=self.batch_size, num_threads=self.num_threads, device_id=self.device_id,
                      seed=self.seed + 1000 * self.shard_id, prefetch_queue_depth=self.options.prefetch_queue_depth,
                      py_num_workers=self.options.py_workers, py_start_method="spawn")
        def pipeline():
            if self.from_store:
                jpegs, labels, index = fn.external_source(
                    source=self._src, num_outputs=3, batch=False, parallel=True,
                    dtype=[types.UINT8, types.INT64, types.INT64], ndim=[1, 1, 1],
                    prefetch_queue_depth=self.options.prefetch_queue_depth)
            else:
                jpegs, labels = fn.readers.file(
                    files=self._files, labels=self._labels, name="Reader", shard_id=self.shard_id,
                    num_shards=self.num_shards, shuffle_after_epoch=self.shuffle, seed=self.seed,
                    pad_last_batch=False)
                index = labels
            if self.train:
                extra = dict(preallocate_width_hint=_PREALLOCATE_WIDTH_HINT,
                             preallocate_height_hint=_PREALLOCATE_HEIGHT_HINT) if mixed else {}
                images = fn.decoders.image_random_crop(
                    jpegs, device=decoder_device, output_type=types.RGB, random_area=[0.08, 1.0],
                    random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10, **gpu_kw, **extra)
                images = fn.resize(images, resize_x=self.size, resize_y=self.size,
                                   interp_type=types.INTERP_LINEAR, antialias=True)
                mirror = fn.random.coin_flip(probability=0.5)
                crop = None
            else:
                images = fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB, **gpu_kw)
                images = fn.resize(images, resize_shorter=self.options.resize, interp_type=types.INTERP_LINEAR,
                                   antialias=True)
                mirror, crop = 0, (self.size, self.size)
            raw = self.options.dtype == torch.uint8  # crop, flip and CHW layout, the pixels as they are
            norm = {} if raw else dict(mean=[m * 255 for m in self.options.mean],
                                       std=[s * 255 for s in self.options.std])
            # channels_last: written HWC (interleaved, as decoded) and handed out as its NCHW view, not transposed
            layout = "HWC" if self.options.channels_last else "CHW"
            images = fn.crop_mirror_normalize(images, dtype=types.UINT8 if raw else types.FLOAT, output_layout=layout,
                                              crop=crop, crop_pos_x=0.5, crop_pos_y=0.5, mirror=mirror, **norm)
            if mixed:
                labels = labels.gpu()
            return images, labels, index

        return pipeline()

    def _make_iterator(self, epoch: int = 0, start_batch: int = 0):
        """A pipeline whose first batch is batch ``start_batch`` of ``epoch`` (stores: also mid-epoch)."""
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        size = self.samples_per_epoch
        if self.from_store:
            resumed = self._src.first is not None and self._src.epoch_offset == epoch
            if start_batch or resumed:  # the rest of this epoch's list, from that batch on
                size = self._src.resume(epoch, self._list[start_batch * self.batch_size:])
            else:
                self._src.epoch_offset, self._src.first = epoch, None
        self._pipe = self._build()
        try:
            self._pipe.build()
        except RuntimeError as exc:
            if "Workers initialization failed" in str(exc):
                raise WorkerStartError(_GUARD_HINT) from exc
            raise
        policy = LastBatchPolicy.DROP if self.drop_last else LastBatchPolicy.PARTIAL
        with warnings.catch_warnings():
            # We pad the epoch ourselves and pass its true size: that is what the warning asks about.
            warnings.filterwarnings("ignore", message=".*reader_name.*")
            if self.from_store:
                return DALIGenericIterator([self._pipe], ["images", "labels", "index"], size=size,
                                           last_batch_policy=policy, last_batch_padded=True, auto_reset=True)
            return DALIGenericIterator([self._pipe], ["images", "labels", "index"], reader_name="Reader",
                                       last_batch_policy=policy, auto_reset=True)

    # ---- iterating ------------------------------------------------------------------------

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        n = self.samples_per_epoch
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # not a generator itself: the clock starts at iter(), as fastload.DataLoader's does, and covers
        # building the pipeline (its workers' start) and, from a store in object storage, the first downloads
        return self._timed(self._positioned(), time.perf_counter())

    def _timed(self, batches: Iterator, t0: float) -> Iterator:
        """``batches``, recording ``time_to_first_batch`` at the first (and logging it for a URL, INFO on
        the ``fastload`` logger, as ``fastload.DataLoader`` does)."""
        epoch = self.epoch
        for n, batch in enumerate(batches):
            if n == 0:
                self.time_to_first_batch = time.perf_counter() - t0
                if self.from_store and self._reader.shard_ordered:
                    logging.getLogger("fastload").info(
                        "fastload: first batch of epoch %d from %s after %.2f s (DALI, device=%s)", epoch,
                        self.source, self.time_to_first_batch, self.device)
            yield batch

    def _epoch_batches(self) -> Iterator:
        epoch = self.epoch
        self.epoch += 1
        if self._partial:  # the last pipeline started mid-epoch: its epochs do not line up
            self.close()
            self._partial = False
        if self.from_store:
            resumed = self._src.first is not None and self._src.epoch_offset == epoch
            self._list = self._src.first if resumed else self._src.order(epoch)  # batch k is _list[k*b:]
        self._windows = self._src.shards.windows(self._list) \
            if self.by_shards and hasattr(self._reader, "prefetch_shards") else []
        k, failures = 0, 0
        while k < len(self):
            found = None
            self._prefetch(k)
            try:
                if self._iter is None:  # DALI's iterator runs the pipeline already when it is made
                    self._partial = self._partial or k > 0
                    self._iter = self._make_iterator(epoch, k)
                out = next(self._iter)[0]
            except StopIteration:
                return
            except WorkerStartError:
                raise
            except Exception as exc:
                found = self._explain(exc, epoch, k, every=self.on_error == "skip")
                self.close()
                if self.on_error != "skip" or found[0].index is None:
                    found[0].add_note(f"DALI reported: {str(exc)[:2000]}")
                    found = found[:1]
            if found is not None and (self.on_error != "skip" or found[0].index is None):
                found[0].__context__ = found[0].__cause__ = None
                raise found[0]  # outside the except block: no link to DALI's exception (see below)
            if found is not None:
                # Outside the except block, with no link to DALI's exception: its traceback would keep
                # the failed pipeline and its threads alive (and a later fork() could then deadlock).
                for bad in found:  # every bad sample near the failure: one rebuild for all of them
                    bad.__context__ = bad.__cause__ = None
                    failures += 1
                    self.skipped += 1
                    record_skip(self.source, bad, skipped=self.skipped, run=failures,
                                where=f"near batch {k} of epoch {epoch}")
                    self._src = self._src.without(bad.index)  # rebuilt at the same batch, the sample replaced
                continue
            failures = 0
            images, labels = out["images"], out["labels"].view(-1).to(torch.int64)
            if self.options.channels_last:  # NHWC from the pipeline: its NCHW view is channels-last already
                images = images.permute(0, 3, 1, 2)
            if images.dtype != self.options.dtype:
                images = images.to(self.options.dtype)
            k += 1
            if self.return_index:
                yield images, labels, out["index"].view(-1).to(torch.int64)
            else:
                yield images, labels
        try:  # the iterator ends its epoch (auto_reset) after the last batch
            next(self._iter)
        except StopIteration:
            pass

    def _prefetch(self, k: int) -> None:
        """Start downloading the next window's shards once the workers may be reading the window
        before it: they run up to ``prefetch_queue_depth`` batches ahead of batch ``k``."""
        reach = (k + self.options.prefetch_queue_depth + 1) * self.batch_size
        while self._windows and self._windows[0][0] < reach:
            ahead = self._windows.pop(0)[2]
            if ahead:
                self._reader.prefetch_shards(ahead)

    def _explain(self, exc: BaseException, epoch: int, iteration: int, *,
                 every: bool = False) -> list[CorruptSampleError]:
        """Find which sample DALI failed on (it does not say): checksums, then a CPU decode of the
        candidates (the batches DALI may have been working on). The first failing one, or with
        ``every`` all of them; one error without an index when none fails on the CPU."""
        from fastload.image.fast import decode_rgb_fast
        from fastload.image.policy import sample_error

        found: list[CorruptSampleError] = []
        if self.from_store:
            b = self.batch_size
            window = self._list[iteration * b:(iteration + self.options.prefetch_queue_depth + 2) * b]
            for index in dict.fromkeys(self._src.replace(int(i)) for i in window):
                try:
                    decode_rgb_fast(self._reader.get(index))
                except Exception as bad:
                    found.append(sample_error(self.source, index, self._reader.relpath(index), bad))
                    if not every:
                        break
            return found or [CorruptSampleError(f"{self.source}: DALI failed on a batch near iteration {iteration} "
                                                f"of epoch {epoch}, and every sample in it decodes on the CPU:\n{exc}")]
        for path in self._files:  # the reader's own shuffle is not ours to replay: check the shard
            try:
                decode_rgb_fast(Path(path).read_bytes())
            except Exception as bad:
                return [CorruptSampleError(f"{path}: failed to decode: {bad}\nHINT: pack the folder with "
                                           "`fastload convert` first; it skips and reports bad files.")]
        return [CorruptSampleError(f"{self.source}: DALI failed and no file fails to decode on the CPU:\n{exc}")]

    def close(self) -> None:
        """Stop the pipeline and its worker processes (a later ``iter()`` builds a new one)."""
        self._iter = None
        self._partial = False
        if self._pipe is not None:
            del self._pipe
            self._pipe = None

    # ---- resume (state_dict / load_state_dict: the seam is tracker.DALITracker, the rules state.py's) -----

    def resume_facts(self) -> dict:
        """What a saved state must match (``state.check_dali_state``'s keywords): fixed when the loader is
        built; the data's identity is hashed once, not at every checkpoint."""
        if "_identity" not in self.__dict__:
            if self.from_store:  # the store's checksums and labels (self._reader)
                self._identity = _state.dataset_identity(self)
            else:
                self._identity = _state.files_identity(str(self.source), sorted(set(zip(self._files, self._labels))))
        return {"source": "store" if self.from_store else "folder",
                "length": self._src.n if self.from_store else len(set(self._files)), "identity": self._identity,
                "seed": self.seed, "shuffle": self.shuffle, "batch_size": self.batch_size, "world": self.num_shards,
                # how the epoch is ordered: None (global) or {"window": w} (by shards)
                "shards": {"window": self.options.window} if self.by_shards else None}

    def state_dict(self) -> dict:
        """This loader's position: resume with ``load_state_dict`` on a loader built the same way.

        From a store the order is a function of (seed, epoch, position): resume is exact,
        also under another world size (``fastload.load.state``'s elastic rule). From a
        folder, see ``load_state_dict``. Small (no sample data), picklable, ``torch.save``-able.
        """
        return self._tracker.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue from ``state_dict()``'s result at the next ``iter()``.

        From a store: exact (same samples in the same order; under another world size the
        remaining samples of the epoch are split over the new ranks, each read once).
        DALI's augmentation RNG (crop, flip) restarts from ``seed`` in the resumed pipeline:
        the same samples, but not the same random crops as the uninterrupted run.
        From a folder: DALI's file reader owns the order, so the position is restored by
        reading and discarding the batches already seen: exact without shuffle and in epoch
        0; with shuffle in a later epoch, a mid-epoch state is refused (the reader's
        reshuffle sequence cannot be replayed), and an epoch-boundary state continues with
        the reader's order restarted (each sample still once per epoch). During a resumed
        epoch from a store, ``len()`` is the number of batches left in it.

        Raises:
            ResumeStateError: corrupt, or saved for another source, store, seed, shuffle,
                batch size, or (folder) world size; or the folder case above.
        """
        sd = self._tracker.check(self, state_dict)
        if not self.from_store and self.shuffle and sd.epoch > 0 and sd.batches > 0:
            raise ResumeStateError(
                f"{self.source}: a mid-epoch state of epoch {sd.epoch} from a shuffled folder cannot be "
                "resumed exactly: DALI's file reader reshuffles with its own RNG.\nHINT: pack the folder with "
                "`fastload convert` and read the store (exact resume), or resume from an epoch boundary.")
        self.close()
        self.epoch = sd.epoch
        self._tracker.load(sd)

    def _positioned(self):
        """The next epoch's batches, reported to the tracker, from where a loaded plan says."""
        plan = self._tracker.take_plan()
        epoch = plan.epoch if plan is not None else self.epoch
        skip, order, rank_len, restore = 0, None, None, None
        if plan is not None and plan.batches and self.from_store:
            order, remaining = self._resume_remaining(plan)
            rank_len = len(remaining)
            restore = self.samples_per_epoch
            self.samples_per_epoch = self._src.resume(epoch, remaining)
        elif plan is not None and self.from_store:
            self._src.epoch_offset, self._src.first = epoch, None
        elif plan is not None:
            skip = plan.batches
        if order is None and self.by_shards:
            order, rank_len = _state.DALIShardOrder(self._src.shard_order(epoch).state_dict()), self._src.per_rank
        elif order is None and self.from_store:
            order, rank_len = _state.DALIGlobalOrder(start=0, world=self.num_shards, consumed=0), self._src.per_rank
        self._tracker.epoch_started(epoch, plan.batches if plan is not None else 0, order, rank_len)
        try:
            if self.samples_per_epoch > 0:
                for n, batch in enumerate(self._epoch_batches()):
                    if n < skip:  # a folder: read and discard what was already seen
                        continue
                    self._tracker.batch_yielded()
                    yield batch
            else:
                self.epoch += 1
            self._tracker.epoch_ended()
        finally:
            if restore is not None:  # the next epoch is a plain one: rebuild the pipeline for it
                self.close()
                self.samples_per_epoch = restore
                self._src.first, self._src.epoch_offset = None, epoch + 1

    def _resume_remaining(self, plan: _state.DALIState) -> tuple[_state.DALIShardOrder | _state.DALIGlobalOrder, list]:
        """The new segment and this rank's indices left in the saved epoch (the elastic rule)."""
        saved = plan.order
        if self.by_shards:  # ShardOrder's own elastic rule, from the saved segments
            if not isinstance(saved, _state.DALIShardOrder):
                raise ResumeStateError(f"{self.source}: a mid-epoch state without the position of a shard-ordered "
                                       "epoch.\nHINT: the checkpoint was damaged or edited; resume from an "
                                       "earlier one.")
            rest = self._src.shard_order(plan.epoch, saved.sampler)
            mine = rest.order()
            return _state.DALIShardOrder(rest.state_dict()), mine
        perm = self._src.global_order(plan.epoch).tolist()
        world = self.num_shards
        if saved is None:
            saved = _state.DALIGlobalOrder(start=0, world=world, consumed=plan.batches * self.batch_size * world)
        if world == saved.world:
            start, consumed = saved.start, saved.consumed
        else:
            start, consumed = saved.start + min(saved.consumed, len(perm) - saved.start), 0
        mine = _state.segment(perm, start, world, False)[consumed + self.shard_id::world]
        return _state.DALIGlobalOrder(start=start, world=world, consumed=consumed), mine
