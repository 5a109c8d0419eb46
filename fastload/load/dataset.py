"""``LMDBImageDataset``: a store as a map-style dataset that behaves like ``ImageFolder``.

Owns: the dataset object (``classes``, ``class_to_idx``, ``targets``, ``samples``,
``get_bytes``), choosing the decode path per transform, and the ``on_error`` policy.

Decode path: with no transform, or any torchvision-style transform, a sample is the PIL
RGB image ``ImageFolder`` would give (Pillow's decoder). When the transform is a preset
(``is_preset``: the ``Preset`` contract of ``transforms.py``) it gets the stored bytes and
decodes only what it needs.

Must not: open LMDB in ``__init__`` beyond reading the metadata (handles are per process,
in ``store.reader.StoreReader``), or batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.utils.data

from fastload.errors import CorruptSampleError
from fastload.image.fast import decode_pil
from fastload.image.policy import sample_error
from fastload.load.skips import check_on_error, record_skip
from fastload.load.transforms import is_preset, preset_channels_last, preset_plans
from fastload.store.readers import Reader, ReaderOptions, open_store_reader

__all__ = ["LMDBImageDataset", "reads_by_shard", "plans_samples", "planned_items", "getitems_planned", "put_in_slot",
           "try_plan", "item_from_plan", "PlannedBatch", "PLAN_RUN"]


class _Samples(Sequence):
    """``samples`` as ImageFolder has it — ``(relpath, label)`` — without a million tuples."""

    def __init__(self, paths: list[str], labels) -> None:
        self._paths, self._labels = paths, labels

    def __len__(self) -> int:
        return len(self._paths)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return self._paths[i], int(self._labels[i])


class LMDBImageDataset(torch.utils.data.Dataset):
    """A fastload store as an ``ImageFolder``-compatible dataset.

    Args:
        path: a store written by ``fastload convert`` (or a directory of its shards), or the URL
            of a sharded store in object storage (``s3://bucket/store/``, ``gs://``, ``az://``):
            its shards are fetched whole into a node-local cache as they are read
            (``store/cache.py``), and ``fastload.DataLoader`` reads it with a ``ShardSampler``.
        cache_dir: for a URL: the node's shard cache directory (default ``shards`` in fastload's cache folder:
            ``$FASTLOAD_CACHE/shards``, else ``~/.cache/fastload/shards``).
        cache_limit: for a URL: the bytes that cache may hold (``"20GB"``; default no limit).
        transform: applied to the PIL image; a fastload preset (``train_transform()``,
            ``eval_transform()``) gets the stored bytes instead and uses the fast path.
        target_transform: applied to the label.
        on_error: ``"raise"`` (default): a sample that fails to decode raises
            ``CorruptSampleError`` naming store, index and relative path. ``"skip"``: use
            the next good sample instead, log it and count it in ``skipped``; more than
            20 failures in a row raise ``TooManyCorruptSamplesError``.
        readahead: OS readahead for the LMDB map. Off by default: it only helps
            sequential scans, and for random reads of a store larger than RAM it fills the
            page cache with pages nobody asked for.

    Attributes:
        time_to_first_batch: for a URL, seconds from ``iter(loader)`` to the first batch of the
            latest epoch a ``fastload.DataLoader`` read from it (None before; also logged at INFO
            on the ``fastload`` logger, and on the loader as ``loader.time_to_first_batch``).

    Raises:
        NotAStoreError, IncompleteStoreError, StoreVersionError: ``path`` is unusable.
    """

    time_to_first_batch: float | None = None

    def __init__(self, path: str | os.PathLike[str], transform: Callable | None = None,
                 target_transform: Callable | None = None, *, on_error: str = "raise",
                 readahead: bool = False, cache_dir: str | os.PathLike[str] | None = None,
                 cache_limit: int | str | None = None) -> None:
        check_on_error(on_error)
        self._reader: Reader = open_store_reader(
            path, ReaderOptions(readahead=readahead, cache_dir=cache_dir, cache_limit=cache_limit))
        self.root = str(path)
        self.transform = transform
        self.target_transform = target_transform
        self.on_error = on_error
        self.classes: list[str] = list(self._reader.classes)
        self.class_to_idx: dict[str, int] = {c: i for i, c in enumerate(self.classes)}
        self._targets: list[int] | None = None
        self.skipped = 0  # samples replaced under on_error="skip", in this process

    @property
    def reader(self) -> Reader:
        """The store's reader (``store.readers.Reader``): what the dataset reads, and what it declares."""
        return self._reader

    @property
    def targets(self) -> list[int]:
        """Every sample's label. For a remote store: one small GET of its ``samples.json.gz``, no
        shard downloaded; a store converted before that object existed (manifest format 1) has
        its labels in the shards only, and this downloads every shard."""
        if self._targets is None:
            index = self._reader.sample_index()
            self._targets = list(index[0]) if index is not None else [self._reader.label(i) for i in range(len(self))]
        return self._targets

    @targets.setter
    def targets(self, value: list[int]) -> None:
        self._targets = value

    @property
    def samples(self) -> Sequence:
        """``(relpath, label)`` per sample, as ImageFolder has it (a URL: as ``targets``)."""
        index = self._reader.sample_index()
        if index is not None:
            return _Samples(index[1], index[0])
        return [(self._reader.relpath(i), t) for i, t in enumerate(self.targets)]

    def prefetch_shards(self, shards: list[int]) -> None:
        """Download these shards in the background (stores in object storage; ``ShardSampler`` calls it)."""
        self._reader.prefetch_shards(shards)

    def __len__(self) -> int:
        return len(self._reader)

    @property
    def shard_sizes(self) -> list[int]:
        """Samples per shard, in store order (one entry for a single store): ``ShardSampler`` reads it."""
        return self._reader.shard_sizes

    def get_bytes(self, index: int) -> bytes:
        """The encoded image bytes of sample ``index`` exactly as stored."""
        return self._reader.get(index)

    def _load(self, index: int, generator: torch.Generator | None = None, out: torch.Tensor | None = None) -> Any:
        data = self._reader.get(index)
        try:
            if is_preset(self.transform):
                from_bytes = self.transform.from_bytes
                if out is not None:
                    return from_bytes(data, generator=generator, out=out)
                return from_bytes(data) if generator is None else from_bytes(data, generator=generator)
            img = decode_pil(data)
        except Exception as exc:
            raise sample_error(self.root, index, self._reader.relpath(index), exc) from exc
        return self.transform(img) if self.transform is not None else img

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        return self.getitem(index)

    def plan(self, index: int, generator: torch.Generator | None) -> tuple[bytes, Any]:
        """Phase one of ``getitem`` under a preset that plans (``preset_plans``): the record's bytes
        (checked) and the preset's draws for them. The thread pipeline plans a few samples, then
        ``render``s them. Errors are raised as they come (the caller redoes the sample with
        ``getitem``, which names it and applies ``on_error``)."""
        data = self._reader.get(index)
        return data, self.transform.plan(data, generator)

    def render(self, index: int, planned: tuple[bytes, Any], *, out: torch.Tensor | None = None) -> tuple[Any, Any]:
        """Phase two: ``(image, label)`` of a ``plan``, the image as ``getitem(index, generator=...,
        out=out)`` gives it with the same generator (raises as ``plan`` does)."""
        data, plan = planned
        return self.transform.render(data, plan, out=out), self._reader.label(index)

    def getitem(self, index: int, *, generator: torch.Generator | None = None,
                out: torch.Tensor | None = None) -> tuple[Any, Any]:
        """``dataset[index]``, with a preset's random draws taken from ``generator`` when given.

        The thread pipeline (``load/threads.py``) passes each sample its own generator so
        crops do not depend on which thread ran first. Other transforms ignore it. ``out``:
        only for a preset whose ``from_bytes`` takes it (``preset_writes_into``): handed on,
        so the image may be written there (its batch slot) instead of a new tensor.
        """
        n = len(self)
        if index < 0:
            index += n
        tried = 0
        while True:
            try:
                image = self._load(index, generator, out)
                break
            except CorruptSampleError as exc:
                if self.on_error == "raise":
                    raise
                self.skipped += 1
                tried += 1
                record_skip(self.root, exc, skipped=self.skipped, run=tried, where=f"from index {index - tried + 1}")
                index = (index + 1) % n
        target = self._reader.label(index)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

    def __repr__(self) -> str:
        return (f"LMDBImageDataset({self.root!r}, {len(self)} samples, {len(self.classes)} classes, "
                f"transform={self.transform!r})")


# samples planned back to back before they are rendered (``LMDBImageDataset.plan``/``render``, by the thread
# pipeline's tasks and by worker processes' batches): on 800 real photos, two threads of the per-sample work
# made 1.12-1.14x the images/s of each sample planned and rendered in turn with runs of 4, 8 or 16 (runs of 1:
# 0.99x), one thread 1.03-1.06x (``tools/thread_probes.py STORE runs``)
PLAN_RUN = 8


def plans_samples(dataset: object) -> bool:
    """Whether ``dataset[i]`` may be made as ``plan`` then ``render``: an ``LMDBImageDataset`` whose preset
    plans (``preset_plans``), with no ``target_transform``, and fastload's own ``__getitem__``, ``getitem``
    and ``_load`` (a subclass's override runs as written)."""
    t = type(dataset)
    return (isinstance(dataset, LMDBImageDataset) and preset_plans(dataset.transform)
            and dataset.target_transform is None and t.__getitem__ is LMDBImageDataset.__getitem__
            and t.getitem is LMDBImageDataset.getitem and t._load is LMDBImageDataset._load)


def try_plan(dataset: LMDBImageDataset, index: int, generator: torch.Generator | None) -> tuple[bytes, Any] | None:
    """``dataset.plan(index, generator)``, or None when it raises (``item_from_plan`` then redoes the sample
    with ``getitem``, which names it and applies ``on_error``)."""
    try:
        return dataset.plan(index, generator)
    except Exception:  # noqa: BLE001 - redone, and reported, by getitem
        return None


def item_from_plan(dataset: LMDBImageDataset, index: int, planned: tuple[bytes, Any] | None,
                   redo_generator: Callable[[], torch.Generator | None], *,
                   out: torch.Tensor | None = None) -> tuple[Any, Any]:
    """``(image, label)``: ``dataset.render`` of ``planned``; with no plan, or when render raises,
    ``dataset.getitem(index, generator=redo_generator(), out=out)`` (``out`` passed only when given: a
    subclass's getitem may not take it), which names a bad sample and applies ``on_error``."""
    if planned is not None:
        try:
            return dataset.render(index, planned, out=out)
        except Exception:  # noqa: BLE001 - redone below by getitem
            pass
    gen = redo_generator()
    return dataset.getitem(index, generator=gen) if out is None else dataset.getitem(index, generator=gen, out=out)


def planned_items(dataset: LMDBImageDataset, indices: list[int], seeds: list[int], *,
                  out: torch.Tensor | None = None) -> Iterator[tuple[Any, Any]]:
    """``dataset.getitem(i, generator=torch.Generator().manual_seed(seed))`` for each sample in turn, made in
    runs of ``PLAN_RUN``: each run's samples planned back to back, then rendered (a sample whose plan or
    render fails is redone by ``getitem`` with a new generator seeded alike). ``out``: a batch whose slot
    ``out[k]`` sample ``k``'s image may be rendered into. For ``plans_samples`` datasets only."""
    for start in range(0, len(indices), PLAN_RUN):
        run = range(start, min(start + PLAN_RUN, len(indices)))
        planned = [try_plan(dataset, indices[k], torch.Generator().manual_seed(seeds[k])) for k in run]
        for k, p in zip(run, planned):
            yield item_from_plan(dataset, indices[k], p, lambda seed=seeds[k]: torch.Generator().manual_seed(seed),
                                 out=None if out is None else out[k])


def getitems_planned(dataset: LMDBImageDataset, indices: list[int], seeds: list[int]) -> list[tuple[Any, Any]]:
    """``[dataset.getitem(i, generator=torch.Generator().manual_seed(seed)) for ...]``, made as
    ``planned_items`` makes them."""
    return list(planned_items(dataset, indices, seeds))


def put_in_slot(root: str, index: int, image: Any, slot: torch.Tensor, where: str) -> None:
    """Sample ``index``'s image into its batch slot: nothing to do where the preset rendered it there, else
    copied.

    Raises:
        TypeError: the image is not a ``uint8`` tensor of the slot's shape (``where``: what the slot is in).
    """
    if not isinstance(image, torch.Tensor) or image.dtype != torch.uint8 or image.shape != slot.shape:
        got = f"{image.dtype} {tuple(image.shape)}" if isinstance(image, torch.Tensor) else type(image).__name__
        raise TypeError(f"{root}: sample {index}: the transform gave {got}, expected a uint8 tensor of shape "
                        f"{tuple(slot.shape)} for {where}")
    if image.data_ptr() != slot.data_ptr() or image.stride() != slot.stride():
        slot.copy_(image)


class PlannedBatch(Sequence):
    """A batch's samples under a preset that plans (``plans_samples``), not made yet: a worker process's
    ``dataset.__getitems__`` returns it when its collate can write the images straight into the batch
    (``batch_pool.PooledCollate``), which saves each image's own tensor and its copy into the batch.

    Read as a list (any other collate), it is ``getitems_planned`` of its samples, made once. ``write_into``
    makes the same images (the same draws, the same skips) in the batch's slots instead.
    """

    def __init__(self, dataset: LMDBImageDataset, indices: list[int], seeds: list[int]) -> None:
        self.dataset, self.indices, self.seeds = dataset, indices, seeds
        self._items: list[tuple[Any, Any]] | None = None

    def _made(self) -> list[tuple[Any, Any]]:
        if self._items is None:
            self._items = getitems_planned(self.dataset, self.indices, self.seeds)
        return self._items

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i):
        return self._made()[i]

    def __iter__(self):  # not Sequence's, which would end at an IndexError raised while making the samples
        return iter(self._made())

    def layout(self) -> tuple[int, int, int, int, bool] | None:
        """``(n, c, h, w, channels_last)`` of the batch ``collate_uint8`` would stack these images into, known
        before any is made; None where ``write_into`` is not used. Only for fastload's own ``train_transform``
        (``TrainTransform``, not a subclass): its images are ``uint8``, 3 x ``size`` x ``size``, laid out as
        its ``channels_last`` says. A subclass may change what its images are: its batch is stacked from them
        as before, so that its batches and its errors are those of ``collate_uint8``."""
        from fastload.load.transforms import TrainTransform

        transform = self.dataset.transform  # TrainTransform.from_bytes takes ``out=`` (``preset_writes_into``)
        if self._items is not None or type(transform) is not TrainTransform or not isinstance(transform.size, int):
            return None
        return len(self.indices), 3, transform.size, transform.size, preset_channels_last(transform)

    def write_into(self, out: torch.Tensor) -> list[int]:
        """Make the images in ``out[k]`` (``layout``'s shape and strides) as ``planned_items`` makes them, and
        return the labels.

        Raises:
            TypeError: the preset gave something other than a ``uint8`` image of the slot's shape.
        """
        labels = []
        for k, (image, label) in enumerate(planned_items(self.dataset, self.indices, self.seeds, out=out)):
            put_in_slot(self.dataset.root, self.indices[k], image, out[k], "the batch")
            labels.append(int(label))
        return labels


def reads_by_shard(dataset: object) -> bool:
    """True for a dataset whose store reader declares ``shard_ordered`` (a store in object storage): a loader
    given no sampler reads it with a ``ShardSampler``. The reader is the dataset's ``reader``: a fastload
    dataset's own, or the one a user's wrapper around it hands on (``self.reader = inner.reader``), checked
    against the ``Reader`` protocol, never a flag."""
    from fastload.store.readers import Reader

    reader = getattr(dataset, "reader", None)
    return isinstance(reader, Reader) and bool(reader.shard_ordered)
