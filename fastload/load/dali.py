"""``DALILoader``: NVIDIA DALI pipelines with the same batch contract as the DataLoader path.

Owns: building the DALI graph (train: decode + random-resized crop + flip + normalise;
eval: decode + resize shorter side + center crop + normalise) on the GPU (``device="mixed"``
nvJPEG decode, hardware decoder where the GPU has one) or the CPU (``device_id=None``),
feeding it from a store (parallel ``external_source``, global per-epoch shuffle) or an
ImageFolder tree (``fn.readers.file``), sharding under ``torch.distributed``, and turning
DALI's failures into errors that name the sample.

Batches are ``(images, labels)``: images float NCHW normalised (ImageNet mean/std unless
told), labels ``int64`` 1-D, on the GPU in GPU mode and on the CPU in CPU mode — what
``fastload.DataLoader`` + ``DevicePrefetcher`` give.

Training crops use ``fn.decoders.image_random_crop``: the decoder draws the crop
(``random_area`` / ``random_aspect_ratio``, RandomResizedCrop's parameters) and decodes only
that region (nvJPEG on the GPU, libjpeg-turbo on the CPU), then ``fn.resize`` brings it to
``size``; this is the same augmentation as ``fn.random_resized_crop`` after a full decode,
without decoding pixels that are thrown away.

Shuffling: from a store, a global permutation per epoch (``_dali_source``), never DALI's
reader buffer (``random_shuffle`` shuffles within ``initial_fill`` samples, 1024 by default,
which measurably costs accuracy on class-sorted data). From a folder, the file list is
permuted once by ``seed`` and the reader reshuffles the whole list after every epoch
(``shuffle_after_epoch``).

Distributed (an initialised ``torch.distributed`` group, or ``shard_id``/``num_shards``):
every rank gets ``ceil(n / world)`` samples, the shortfall padded by wrapping around the
epoch's order as ``DistributedSampler`` does, so all ranks run the same number of batches.

DALI is imported inside functions: ``import fastload`` works without it; constructing a
loader without it raises ``MissingDependencyError`` with the pip command.

Must not: be imported by ``fastload/__init__`` eagerly.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from fastload.errors import CorruptSampleError, MissingDependencyError, ResumeStateError
from fastload.load import state as _state
from fastload.load.transforms import IMAGENET_MEAN, IMAGENET_STD

__all__ = ["DALILoader", "dali_available"]

# The DALI ResNet-50 example's pre-allocation hints for nvJPEG: they avoid reallocations
# (and the stalls they cause) during the first epochs on ImageNet-sized images.
_DEVICE_MEMORY_PADDING = 211_025_920
_HOST_MEMORY_PADDING = 140_544_512
_PREALLOCATE_WIDTH_HINT = 5_980
_PREALLOCATE_HEIGHT_HINT = 6_430


def dali_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali") is not None


def _require_dali():
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            "DALI is not installed.\nHINT: pip install 'fastload[dali]'   (nvidia-dali-cuda130, matching torch's "
            "CUDA 13 build; CPU mode works without a GPU)"
        ) from None


def _is_store(path: Path) -> bool:
    from fastload.store import format as fmt

    return fmt.is_store_dir(path) or bool(fmt.find_shards(path))


class DALILoader:
    """Batches from a DALI pipeline over a store or an ImageFolder tree.

    Args:
        source: a store written by ``fastload convert`` (or a shard directory), or an
            ImageFolder tree.
        batch_size: samples per batch.
        train: random-resized crop + flip (True) or resize + center crop (False).
        size: output side; ``resize``: the shorter side before the eval center crop.
        device: ``"auto"`` (GPU when one is visible, else CPU), ``"gpu"`` or ``"cpu"``.
        num_threads: DALI CPU threads; ``"auto"`` = ``auto_num_workers()`` (at least 1).
        py_workers: processes for the store callback (reading bytes; cheap).
        seed: drives the epoch shuffle (same on every rank) and augmentation (+ rank).
        shuffle: default ``train``.
        drop_last: drop each epoch's partial last batch instead of returning it.
        mean, std: normalisation, on the 0..1 scale.
        dtype: float dtype of the images handed out; ``channels_last`` their memory format.
        shard_id, num_shards: default from ``torch.distributed`` when initialised, else 0, 1.
        device_id: the GPU (default: the current CUDA device).
        hw_decoder_load: share of JPEG decoding sent to the GPU's hardware decoder (A100,
            H100/H200 have one; ignored elsewhere and on the CPU).
        prefetch_queue_depth: batches DALI prepares ahead.
        return_index: also yield each sample's store index (folder source: its label), as a
            third element, for checks and debugging.

    Raises:
        MissingDependencyError: DALI is not installed.
        CorruptSampleError: (when iterating) a sample failed to decode; names the store
            index and relative path (or the file).
    """

    def __init__(self, source: str | os.PathLike[str], batch_size: int, *, train: bool = True, size: int = 224,
                 resize: int = 256, device: str = "auto", num_threads: int | str = "auto", py_workers: int = 1,
                 seed: int = 0, shuffle: bool | None = None, drop_last: bool = False,
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 dtype: torch.dtype = torch.float32, channels_last: bool = False, shard_id: int | None = None,
                 num_shards: int | None = None, device_id: int | None = None, hw_decoder_load: float = 0.65,
                 prefetch_queue_depth: int = 2, return_index: bool = False) -> None:
        _require_dali()
        if device not in ("auto", "gpu", "cpu"):
            raise ValueError(f"Unknown value {device!r} for argument device. Valid values are 'auto', 'gpu', 'cpu'.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if device == "auto":
            device = "gpu" if torch.cuda.is_available() else "cpu"
        if device == "gpu" and not torch.cuda.is_available():
            raise ValueError("device='gpu' needs a CUDA GPU and none is visible; use device='cpu' or 'auto'.")
        if num_threads == "auto":
            from fastload.load.workers import auto_num_workers

            num_threads = max(1, auto_num_workers())
        self.source = Path(source)
        self.batch_size, self.train, self.size, self.resize = batch_size, train, size, resize
        self.device, self.num_threads, self.py_workers = device, int(num_threads), py_workers
        self.seed = seed
        self.shuffle = train if shuffle is None else shuffle
        self.drop_last = drop_last
        self.mean, self.std = tuple(mean), tuple(std)
        self.dtype, self.channels_last = dtype, channels_last
        self.hw_decoder_load, self.prefetch_queue_depth = hw_decoder_load, prefetch_queue_depth
        self.return_index = return_index
        import torch.distributed as dist

        if shard_id is None or num_shards is None:
            if dist.is_available() and dist.is_initialized():
                shard_id, num_shards = dist.get_rank(), dist.get_world_size()
            else:
                shard_id, num_shards = 0, 1
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"need 0 <= shard_id < num_shards, got {shard_id}, {num_shards}")
        self.shard_id, self.num_shards = shard_id, num_shards
        self.device_id = (device_id if device_id is not None else torch.cuda.current_device()) \
            if device == "gpu" else None
        self.from_store = _is_store(self.source)
        if self.from_store:
            from fastload.load._dali_source import StoreSource
            from fastload.store.reader import StoreReader

            self._reader = StoreReader(self.source)
            self._src = StoreSource(self._reader, batch_size, shuffle=self.shuffle, seed=seed, rank=shard_id,
                                    world=num_shards, drop_last=drop_last)
            self.samples_per_epoch = self._src.epoch_samples
        else:
            self._files, self._labels = self._file_list()
            per_rank = len(self._files) // num_shards
            self.samples_per_epoch = per_rank // batch_size * batch_size if drop_last else per_rank
        self._pipe = None
        self._iter = None
        self.epoch = 0

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
                      hw_decoder_load=self.hw_decoder_load) if mixed else {}

        @pipeline_def(batch_size=self.batch_size, num_threads=self.num_threads, device_id=self.device_id,
                      seed=self.seed + 1000 * self.shard_id, prefetch_queue_depth=self.prefetch_queue_depth,
                      py_num_workers=self.py_workers, py_start_method="spawn")
        def pipeline():
            if self.from_store:
                jpegs, labels, index = fn.external_source(
                    source=self._src, num_outputs=3, batch=False, parallel=True,
                    dtype=[types.UINT8, types.INT64, types.INT64], ndim=[1, 1, 1],
                    prefetch_queue_depth=self.prefetch_queue_depth)
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
                images = fn.resize(images, resize_shorter=self.resize, interp_type=types.INTERP_LINEAR,
                                   antialias=True)
                mirror, crop = 0, (self.size, self.size)
            images = fn.crop_mirror_normalize(
                images, dtype=types.FLOAT, output_layout="CHW", crop=crop, crop_pos_x=0.5, crop_pos_y=0.5,
                mean=[m * 255 for m in self.mean], std=[s * 255 for s in self.std], mirror=mirror)
            if mixed:
                labels = labels.gpu()
            return images, labels, index

        return pipeline()

    def _make_iterator(self):
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        self._pipe = self._build()
        self._pipe.build()
        policy = LastBatchPolicy.DROP if self.drop_last else LastBatchPolicy.PARTIAL
        with warnings.catch_warnings():
            # We pad the epoch ourselves and pass its true size: that is what the warning asks about.
            warnings.filterwarnings("ignore", message=".*reader_name.*")
            if self.from_store:
                return DALIGenericIterator([self._pipe], ["images", "labels", "index"], size=self.samples_per_epoch,
                                           last_batch_policy=policy, last_batch_padded=True, auto_reset=True)
            return DALIGenericIterator([self._pipe], ["images", "labels", "index"], reader_name="Reader",
                                       last_batch_policy=policy, auto_reset=True)

    # ---- iterating ------------------------------------------------------------------------

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        n = self.samples_per_epoch
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if not getattr(self, "_resume_inner", False):  # position bookkeeping and resume: _resume_iter
            yield from self._resume_iter()
            return
        if self._iter is None:
            self._iter = self._make_iterator()
        epoch = self.epoch
        self.epoch += 1
        for k in range(len(self)):
            try:
                out = next(self._iter)[0]
            except StopIteration:
                return
            except RuntimeError as exc:
                raise self._explain(exc, epoch, k) from exc
            images, labels = out["images"], out["labels"].view(-1).to(torch.int64)
            if self.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            if images.dtype != self.dtype:
                images = images.to(self.dtype)
            if self.return_index:
                yield images, labels, out["index"].view(-1).to(torch.int64)
            else:
                yield images, labels
        try:  # the iterator ends its epoch (auto_reset) after the last batch
            next(self._iter)
        except StopIteration:
            pass

    def _explain(self, exc: RuntimeError, epoch: int, iteration: int) -> Exception:
        """Find which sample DALI failed on (it does not say) by decoding the candidates on the CPU."""
        from fastload.image.fast import decode_rgb_fast
        from fastload.image.policy import sample_error

        if self.from_store:
            candidates = []
            for it in range(iteration, iteration + self.prefetch_queue_depth + 1):
                candidates += self._src.batch_indices(epoch, it)
            for index in candidates:
                try:
                    decode_rgb_fast(self._reader.get(index))
                except Exception as bad:
                    return sample_error(self.source, index, self._reader.paths[index], bad)
            return CorruptSampleError(f"{self.source}: DALI failed on a batch near iteration {iteration} of epoch "
                                      f"{epoch}, and every sample in it decodes on the CPU:\n{exc}")
        for path in self._files:  # the reader's own shuffle is not ours to replay: check the shard
            try:
                decode_rgb_fast(Path(path).read_bytes())
            except Exception as bad:
                return CorruptSampleError(f"{path}: failed to decode: {bad}\nHINT: pack the folder with "
                                          "`fastload convert` first; it skips and reports bad files.")
        return CorruptSampleError(f"{self.source}: DALI failed and no file fails to decode on the CPU:\n{exc}")

    def close(self) -> None:
        """Stop the pipeline and its worker processes."""
        self._iter = None
        if self._pipe is not None:
            del self._pipe
            self._pipe = None

    # ---- resume (state_dict / load_state_dict; the rules are fastload.load.state's) --------

    def _resume_identity(self) -> str | None:
        if self.from_store:
            return _state.dataset_identity(self)  # the store's checksums and labels (self._reader)
        root = str(self.source)
        return _state.files_identity(root, sorted(set(zip(self._files, self._labels))))

    def state_dict(self) -> dict:
        """This loader's position: resume with ``load_state_dict`` on a loader built the same way.

        From a store the order is a function of (seed, epoch, position): resume is exact,
        also under another world size (``fastload.load.state``'s elastic rule). From a
        folder, see ``load_state_dict``. Small (no sample data), picklable, ``torch.save``-able.
        """
        pending = getattr(self, "_resume_plan", None)
        if pending is not None:
            return dict(pending)
        pos = getattr(self, "_resume_pos", None)
        sd = {"format": _state.DALI_STATE_FORMAT, "version": _state.STATE_VERSION,
              "source": "store" if self.from_store else "folder", "len": self._resume_len(),
              "identity": self._resume_identity(), "seed": self.seed, "shuffle": self.shuffle,
              "batch_size": self.batch_size, "world": self.num_shards, "epoch": self.epoch, "batches": 0,
              "order": None}
        if pos is not None:
            epoch, batches, order = pos
            sd.update(epoch=epoch, batches=batches)
            if order is not None:
                done = batches - order["batches_before"]
                sd["order"] = {"start": order["start"], "world": order["world"],
                               "consumed": order["consumed"] + order["world"] * min(done * self.batch_size,
                                                                                    order["rank_len"])}
        return sd

    def _resume_len(self) -> int:
        return self._src.n if self.from_store else len(set(self._files))

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
        sd = _state.check_dali_state(state_dict, source="store" if self.from_store else "folder",
                                     length=self._resume_len(), identity=self._resume_identity(),
                                     seed=self.seed, shuffle=self.shuffle, batch_size=self.batch_size,
                                     world=self.num_shards)
        if not self.from_store and self.shuffle and sd["epoch"] > 0 and sd["batches"] > 0:
            raise ResumeStateError(
                f"{self.source}: a mid-epoch state of epoch {sd['epoch']} from a shuffled folder cannot be "
                "resumed exactly: DALI's file reader reshuffles with its own RNG.\nHINT: pack the folder with "
                "`fastload convert` and read the store (exact resume), or resume from an epoch boundary.")
        self.close()
        self.epoch = sd["epoch"]
        self._resume_pos = None
        self._resume_plan = sd

    def _resume_iter(self):
        plan, self._resume_plan = getattr(self, "_resume_plan", None), None
        epoch = plan["epoch"] if plan is not None else self.epoch
        skip, order, restore = 0, None, None
        if plan is not None and plan["batches"] and self.from_store:
            order = self._resume_remaining(plan)
            restore = self.samples_per_epoch
            self.samples_per_epoch = self._src.resume(epoch, order.pop("remaining"))
        elif plan is not None and self.from_store:
            self._src.epoch_offset, self._src.first = epoch, None
        elif plan is not None:
            skip = plan["batches"]
        if order is None and self.from_store:
            order = {"start": 0, "world": self.num_shards, "consumed": 0, "rank_len": self._src.per_rank}
        batches = plan["batches"] if plan is not None else 0
        if order is not None:
            order["batches_before"] = batches
        self._resume_pos = (epoch, batches, order)
        self._resume_inner = True
        try:
            if self.samples_per_epoch > 0:
                for n, batch in enumerate(self.__iter__()):
                    if n < skip:  # a folder: read and discard what was already seen
                        continue
                    batches += 1
                    self._resume_pos = (epoch, batches, order)
                    yield batch
            else:
                self.epoch += 1
            self._resume_pos = None
        finally:
            self._resume_inner = False
            if restore is not None:  # the next epoch is a plain one: rebuild the pipeline for it
                self.close()
                self.samples_per_epoch = restore
                self._src.first, self._src.epoch_offset = None, epoch + 1

    def _resume_remaining(self, plan: dict) -> dict:
        """This rank's indices left in the saved epoch (the elastic rule), and the new segment."""
        saved = plan["order"]
        perm = self._src.global_order(plan["epoch"]).tolist()
        world = self.num_shards
        if saved is None:
            saved = {"start": 0, "world": world, "consumed": plan["batches"] * self.batch_size * world}
        if world == saved["world"]:
            start, consumed = saved["start"], saved["consumed"]
        else:
            start, consumed = saved["start"] + min(saved["consumed"], len(perm) - saved["start"]), 0
        mine = _state.segment(perm, start, world, False)[consumed + self.shard_id::world]
        return {"start": start, "world": world, "consumed": consumed, "rank_len": len(mine), "remaining": mine}
