"""``fastload bench loader``: images/s of each loading path on the same data, side by side.

Owns: building each path (torchvision baseline, fastload, fastload on a reduced-resolution
store, WebDataset, DALI CPU, FFCV when importable) with the same batch size and worker
count, timing them in interleaved rounds in one process tree (the median of the rounds is
reported, so a slow moment of the machine hits every path alike), and the single-core
ceiling: a tight decode + crop loop's images/s times the worker count.

Every path ends in the same place: a batch of normalised float images and int64 labels on
the CPU. The torchvision and WebDataset paths normalise in the workers (ToTensor +
Normalize); the fastload paths ship uint8 and normalise in the main process, inside the
timed region.

Must not: assert on timings.
"""

from __future__ import annotations

import importlib.util
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

__all__ = ["LoaderBenchOptions", "LoaderBench", "bench_loader", "torchvision_train_transform"]


@dataclass(frozen=True, kw_only=True)
class LoaderBenchOptions:
    """What to run.

    Args:
        workers: DataLoader workers (DALI: CPU threads) for every path.
        batch_size: images per batch for every path.
        image_size: output side of the random-resized crop.
        batches: timed batches per path per round (after ``warmup``).
        warmup: untimed batches per path per round (first round: worker start-up).
        rounds: interleaved rounds; the median is reported.
        max_side: also pack a store at this reduced longer side and time it.
        paths: the paths to run (default: every one that can run here).
    """

    workers: int = 2
    batch_size: int = 64
    image_size: int = 224
    batches: int = 30
    warmup: int = 4
    rounds: int = 3
    max_side: int | None = None
    paths: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.workers < 0 or self.batch_size < 1 or self.batches < 1 or self.rounds < 1 or self.warmup < 0:
            raise ValueError("workers >= 0, batch_size >= 1, batches >= 1, rounds >= 1 and warmup >= 0 are required")


@dataclass
class PathResult:
    name: str
    images_per_s: float | None
    rounds: list[float] = field(default_factory=list)
    skipped: str | None = None


@dataclass
class LoaderBench:
    options: LoaderBenchOptions
    results: list[PathResult]
    ceiling_per_core: float
    environment: dict

    @property
    def baseline(self) -> float | None:
        return next((r.images_per_s for r in self.results if r.name == "torchvision"), None)

    @property
    def ceiling(self) -> float:
        return self.ceiling_per_core * max(1, self.options.workers)

    def table(self) -> str:
        o = self.options
        lines = [f"batch {o.batch_size}, {o.workers} workers, {o.image_size}px crops, median of {o.rounds} rounds "
                 f"x {o.batches} batches",
                 f"{'path':<26}{'images/s':>10}{'vs torchvision':>16}{'of ceiling':>12}"]
        for r in self.results:
            if r.images_per_s is None:
                lines.append(f"{r.name:<26}{'skipped':>10}  {r.skipped}")
                continue
            ratio = f"{r.images_per_s / self.baseline:.2f}x" if self.baseline else "-"
            lines.append(f"{r.name:<26}{r.images_per_s:>10.0f}{ratio:>16}{r.images_per_s / self.ceiling:>11.0%}")
        lines.append(f"single-core ceiling: {self.ceiling_per_core:.0f} images/s per core (tight decode+crop loop) "
                     f"x {max(1, o.workers)} = {self.ceiling:.0f}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"options": asdict(self.options), "environment": self.environment,
                "ceiling_per_core": self.ceiling_per_core, "ceiling": self.ceiling,
                "paths": [{"name": r.name, "images_per_s": r.images_per_s, "rounds": r.rounds,
                           "ratio": (r.images_per_s / self.baseline) if r.images_per_s and self.baseline else None,
                           "fraction_of_ceiling": (r.images_per_s / self.ceiling) if r.images_per_s else None,
                           "skipped": r.skipped} for r in self.results]}


def torchvision_train_transform(size: int):
    """The standard torchvision training pipeline: the baseline everybody starts from."""
    import torchvision.transforms as T

    from fastload.load.transforms import IMAGENET_MEAN, IMAGENET_STD

    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(),
                      T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


def _forever(make_epoch: Callable[[], Iterable]) -> Iterator:
    while True:
        yield from make_epoch()


class _Path:
    """A named loader: ``batches()`` yields forever; built once, reused by every round."""

    def __init__(self, name: str, make_epoch: Callable[[], Iterable]) -> None:
        self.name = name
        self._it = _forever(make_epoch)

    def time(self, warmup: int, batches: int) -> float:
        for _ in range(warmup):
            next(self._it)
        n = 0
        t0 = time.perf_counter()
        for images, _labels, *_ in itertools.islice(self._it, batches):
            n += len(images)
        return n / (time.perf_counter() - t0)


def _torch_loader_kwargs(o: LoaderBenchOptions) -> dict:
    return dict(batch_size=o.batch_size, shuffle=True, num_workers=o.workers, drop_last=True,
                persistent_workers=o.workers > 0)


def _make_torchvision(data: Path, o: LoaderBenchOptions) -> _Path:
    from torchvision.datasets import ImageFolder

    ds = ImageFolder(str(data), transform=torchvision_train_transform(o.image_size))
    loader = torch.utils.data.DataLoader(ds, **_torch_loader_kwargs(o))
    return _Path("torchvision", lambda: loader)


def _make_fastload(store: Path, o: LoaderBenchOptions, name: str) -> _Path:
    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.loader import DataLoader
    from fastload.load.prefetch import DevicePrefetcher
    from fastload.load.transforms import collate_uint8, train_transform

    ds = LMDBImageDataset(store, transform=train_transform(o.image_size))
    loader = DataLoader(ds, collate_fn=collate_uint8, pin_memory=False, **_torch_loader_kwargs(o))
    return _Path(name, lambda: DevicePrefetcher(loader, "cpu"))


def _make_webdataset(data: Path, o: LoaderBenchOptions, tmp: Path) -> _Path:
    import webdataset as wds
    from torchvision.datasets import ImageFolder

    folder = ImageFolder(str(data))
    n_shards = max(2 * max(1, o.workers), 4)
    per = -(-len(folder.samples) // n_shards)
    urls = []
    for s in range(n_shards):
        url = str(tmp / f"shard-{s:04d}.tar")
        with wds.TarWriter(url) as sink:
            for k, (path, label) in enumerate(folder.samples[s * per:(s + 1) * per]):
                ext = Path(path).suffix.lower().lstrip(".").replace("jpeg", "jpg")
                sink.write({"__key__": f"{s:04d}{k:06d}", ext: Path(path).read_bytes(), "cls": label})
        urls.append(url)
    tf = torchvision_train_transform(o.image_size)
    dataset = (wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False).shuffle(500)
               .decode("pil").to_tuple("jpg;png;jpeg", "cls").map_tuple(tf, lambda c: c)
               .batched(o.batch_size, partial=False))
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=o.workers, persistent_workers=o.workers > 0)
    return _Path("webdataset", lambda: loader)


def _make_dali_cpu(store: Path, o: LoaderBenchOptions) -> _Path:
    from fastload.load.dali import DALILoader

    loader = DALILoader(store, o.batch_size, train=True, size=o.image_size, device="cpu",
                        num_threads=max(1, o.workers), drop_last=True)
    return _Path("dali-cpu", lambda: loader)


def _make_ffcv(data: Path, o: LoaderBenchOptions, tmp: Path) -> _Path:
    """FFCV's own ImageNet recipe: a .beton of the same files, RandomResizedCrop decoder, flip."""
    import numpy as np
    from ffcv.fields import IntField, RGBImageField
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import NormalizeImage, RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage
    from ffcv.writer import DatasetWriter
    from torchvision.datasets import ImageFolder

    from fastload.load.transforms import IMAGENET_MEAN, IMAGENET_STD

    beton = str(tmp / "data.beton")
    writer = DatasetWriter(beton, {"image": RGBImageField(write_mode="jpg", max_resolution=10_000),
                                   "label": IntField()}, num_workers=max(1, o.workers))
    writer.from_indexed_dataset(ImageFolder(str(data)))
    mean = np.array(IMAGENET_MEAN) * 255
    std = np.array(IMAGENET_STD) * 255
    pipelines = {
        "image": [RandomResizedCropRGBImageDecoder((o.image_size, o.image_size)), RandomHorizontalFlip(),
                  NormalizeImage(mean, std, np.float32), ToTensor(), ToTorchImage()],
        "label": [IntDecoder(), ToTensor(), Squeeze()],
    }
    loader = Loader(beton, batch_size=o.batch_size, num_workers=max(1, o.workers), order=OrderOption.RANDOM,
                    drop_last=True, pipelines=pipelines, os_cache=True)
    return _Path("ffcv", lambda: loader)


def single_core_ceiling(store: Path, size: int, seconds: float = 2.0) -> float:
    """Images/s of a tight ``train_transform(size).from_bytes`` loop, one thread."""
    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.transforms import train_transform

    ds = LMDBImageDataset(store)
    tf = train_transform(size)
    blobs = [ds.get_bytes(i) for i in range(min(len(ds), 256))]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for b in blobs[:16]:
            tf.from_bytes(b)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for b in blobs:
                tf.from_bytes(b)
            n += len(blobs)
        return n / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)


ALL_PATHS = ("torchvision", "fastload", "fastload-reduced", "webdataset", "dali-cpu", "ffcv")


def bench_loader(data: str | Path, *, store: str | Path | None = None,
                 options: LoaderBenchOptions = LoaderBenchOptions(), progress: bool = True) -> LoaderBench:
    """Time every loading path over ImageFolder ``data`` (packed to a temporary store if no ``store``)."""
    from tqdm import tqdm

    from fastload.pack.convert import ConvertOptions, convert

    data = Path(data)
    wanted = options.paths or ALL_PATHS
    unknown = set(wanted) - set(ALL_PATHS)
    if unknown:
        raise ValueError(f"Unknown path(s) {sorted(unknown)}. Valid values are {list(ALL_PATHS)}.")
    with tempfile.TemporaryDirectory(prefix="fastload-bench-") as tmpdir:
        tmp = Path(tmpdir)
        if store is None:
            store = tmp / "store.lmdb"
            convert(data, store, ConvertOptions(progress=progress))
        store = Path(store)
        paths: list[tuple[str, _Path]] = []
        results: dict[str, PathResult] = {}

        def add(name: str, build: Callable[[], _Path], missing: str | None = None) -> None:
            if name not in wanted:
                return
            if missing:
                results[name] = PathResult(name, None, skipped=missing)
                return
            paths.append((name, build()))
            results[name] = PathResult(name, None)

        add("torchvision", lambda: _make_torchvision(data, options))
        add("fastload", lambda: _make_fastload(store, options, "fastload"))
        if options.max_side:
            reduced = tmp / "reduced.lmdb"
            if "fastload-reduced" in wanted:
                convert(data, reduced, ConvertOptions(max_side=options.max_side, progress=progress))
            add("fastload-reduced", lambda: _make_fastload(reduced, options, f"fastload (max-side {options.max_side})"))
        has_wds = importlib.util.find_spec("webdataset") is not None
        add("webdataset", lambda: _make_webdataset(data, options, tmp),
            None if has_wds else "webdataset is not installed (pip install 'fastload[bench]')")
        has_dali = importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali")
        add("dali-cpu", lambda: _make_dali_cpu(store, options),
            None if has_dali else "DALI is not installed (pip install 'fastload[dali]')")
        add("ffcv", lambda: _make_ffcv(data, options, tmp), None if importlib.util.find_spec("ffcv") else
            "ffcv is not importable (it needs libopencv-dev, libturbojpeg0-dev, pkg-config, then pip install ffcv)")
        with tqdm(total=options.rounds * len(paths), desc="bench loader", disable=not progress) as bar:
            for _ in range(options.rounds):
                for key, p in paths:
                    results[key].rounds.append(p.time(options.warmup, options.batches))
                    bar.update()
        ordered = []
        for name in ALL_PATHS:
            if name in results:
                r = results[name]
                r.name = _display(name, options)
                if r.rounds:
                    r.images_per_s = statistics.median(r.rounds)
                ordered.append(r)
        ceiling = single_core_ceiling(store, options.image_size)
        paths.clear()  # stop persistent workers before the temporary files go
    from fastload.measure.report import environment

    return LoaderBench(options, ordered, ceiling, environment())


def _display(name: str, o: LoaderBenchOptions) -> str:
    return f"fastload (max-side {o.max_side})" if name == "fastload-reduced" else name
