"""``fastload bench loader``: images/s of each loading path on the same data, side by side.

Owns: the bench-only paths (WebDataset, SPDL in ``_spdl_path.py``, FFCV, when importable)
next to the stages it shares with recipes (``stages.py``: ``torchvision`` is the ``workers``
stage, ``fastload`` the ``fast`` stage, ``fastload-threads`` the ``threads`` stage,
``fastload-reduced`` the ``threads`` stage on a ``--max-side`` store, ``dali-cpu``), all
with the same batch size and worker count; timing them in interleaved rounds; and the
single-core ceiling of each store.

Discipline, so a figure does not depend on which path ran before it:

* every path's loader is built fresh for each round and shut down (workers joined,
  torch's thread count put back, ``stages.running``) before the next path is timed, so no
  path runs beside another's workers refilling their queues;
* round ``k`` runs the paths in the order rotated by ``k`` places;
* the figure is the median of the rounds, and every round's ratio to torchvision *in that
  round* is reported, with its spread;
* a path that fails on the data is reported as skipped with the reason; the others go on.

Every path ends in the same place: a batch of normalised float32 images and int64 labels
on the CPU. torchvision and WebDataset normalise in the workers (ToTensor + Normalize);
fastload and SPDL ship uint8 and normalise in the main process, inside the timed region
(``DevicePrefetcher``'s helper thread, one batch ahead, while the loop takes the next batch);
DALI and FFCV normalise in their own pipelines. With ``uint8`` (``--uint8``) the place is a
GPU host's: ``uint8`` NCHW batches, cropped, resized and flipped, not normalised (torchvision
and WebDataset end in ``PILToTensor``, DALI's ``crop_mirror_normalize`` writes ``uint8``,
fastload hands its batches on as they are, SPDL's channels-last batches are made contiguous
NCHW in the timed loop; FFCV is not run in that form). With ``channels_last``
(``--channels-last``) every batch ends ``torch.channels_last`` (a model trained so takes it
without a transpose): fastload's presets write it so (``channels_last=True``), the floors
use that preset and normalise into a channels-last buffer, and any other path's batch is
converted in the timed loop (``contiguous(memory_format=torch.channels_last)``, a no-op for
a batch that already is).

Two floors per core, measured on each store a path reads (``store_floors``, tight one-thread
loops on its first records, as many crops of them as a path's round takes: the preset's cost moves
with the crop, so the floors average as many crops as the paths do), in every round as an arm of its
own beside the paths, so each round's images/s is held to the ceiling measured in that round (a
shared machine's speed moves between minutes: in one session the preset floor moved 1,092-1,651
images/s between runs): **decode alone** (each record's crop decoded at the DCT scale or region
the preset uses, the draws made beforehand) and **the preset's whole per-image work**
(``train_transform().from_bytes``: header, draws, decode,
resize, flip), with the preset/decode ratio per round; and **normalisation per batch** (one
``uint8`` batch to normalised float32 with ``fastload.normalize``, one thread, into a reused
buffer as ``DevicePrefetcher`` writes it). The ceiling every path is reported against ("of
ceiling", what the pipeline costs beyond the work every path must do) is, per core, the
preset's whole work plus the normalisation of its image (normalised float batches), or the
preset's work alone (``uint8`` batches), times the worker count. With two or more workers the
preset's loop also runs in as many processes at once (``PresetProcesses``, an arm of every round:
cores busy together slow each other down, so n times one core alone is a ceiling no path can
reach), and the ceiling takes each process's rate there instead of one core's alone; the old
ceiling stays beside it ("of n x 1 core"). The decode floor times the
workers (scaled as the preset's processes at once were, when measured) is the other column ("of
decode", what preset and pipeline cost beyond the decode). "Of
ceiling" is the median over the rounds of each round's fraction, with their spread. A
reduced-resolution store has its own floors (it is different data; its ratio to
torchvision compares against the original files, which is the choice a user has).

Must not: assert on timings.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path


from fastload.bench import _spdl_path as _spdl
from fastload.image import DEFAULT_SIZE
from fastload.measure.rounds import interleave
from fastload.measure.stages import BuiltStage, StageData, StageOptions, build_stage, running
from fastload.measure.timing import one_torch_thread
from fastload.pack.sources import IMG_EXTENSIONS

__all__ = ["LoaderBenchOptions", "LoaderBench", "PathResult", "Floors", "bench_loader", "single_core_ceiling",
           "store_floors", "floor_records", "floor_crops", "PresetProcesses", "together_rate", "preset_passes",
           "FLOOR_RECORDS", "FLOOR_BYTES", "FLOOR_CROPS", "ALL_PATHS"]


@dataclass(frozen=True, kw_only=True)
class LoaderBenchOptions:
    """What to run.

    Args:
        workers: DataLoader workers (DALI: CPU threads) for every path.
        batch_size: images per batch for every path.
        image_size: output side of the random-resized crop.
        batches: timed batches per path per round (after ``warmup``).
        warmup: untimed batches per path per round (each round starts the path's workers).
        rounds: interleaved rounds, order rotated each round; the median is reported.
        max_side: also pack a store at this reduced longer side and time it, read by the thread
            pipeline (fastload's fastest path; the ``threads`` stage).
        reduced_encoding: ``convert --encoding`` of that store (``jpeg``, ``raw``: pixels, no
            decode, or ``auto``).
        paths: the paths to run (default: every one that can run here).
        step_ms: a simulated training step after every batch (``train.SimulatedStep``), so the
            loader runs beside a training loop; 0 (default): the loader alone, as fast as it goes.
        host_ms: of each step, the host CPU ms that hold the GIL (kernel launches); the rest of
            ``step_ms`` is slept. Loader threads in this process compete with it for the GIL,
            worker processes do not.
        uint8: every path hands out ``uint8`` batches, not normalised (a GPU host's case; the
            module docstring), instead of normalised float32.
        floor_seconds: how long each floor's loop (decode, preset, normalise) runs in each round, at
            least: the decode and preset loops run whole passes over their crops (``floor_crops``).
        channels_last: every path hands out ``torch.channels_last`` batches (the module docstring).
    """

    workers: int = 2
    batch_size: int = 64
    image_size: int = DEFAULT_SIZE
    batches: int = 30
    warmup: int = 4
    rounds: int = 3
    max_side: int | None = None
    reduced_encoding: str = "jpeg"
    paths: tuple[str, ...] | None = None
    step_ms: float = 0.0
    host_ms: float = 0.0
    uint8: bool = False
    floor_seconds: float = 1.0
    channels_last: bool = False

    def __post_init__(self) -> None:
        from fastload.image.policy import ENCODING_CHOICES

        if self.floor_seconds <= 0:
            raise ValueError(f"floor_seconds must be > 0, got {self.floor_seconds}")
        if self.step_ms < 0 or self.host_ms < 0:
            raise ValueError(f"step_ms and host_ms must be >= 0, got {self.step_ms}, {self.host_ms}")
        if self.workers < 0 or self.batch_size < 1 or self.batches < 1 or self.rounds < 1 or self.warmup < 0:
            raise ValueError("workers >= 0, batch_size >= 1, batches >= 1, rounds >= 1 and warmup >= 0 are required")
        if self.reduced_encoding not in ENCODING_CHOICES:
            raise ValueError(f"Unknown value {self.reduced_encoding!r} for argument reduced_encoding. Valid values are "
                             f"{', '.join(ENCODING_CHOICES)}.")


@dataclass
class PathResult:
    """One path: the median images/s, every round (and the round it ran in), the ratio to
    torchvision within each round, the ceiling of the store it reads, or why it was skipped."""

    name: str
    images_per_s: float | None
    rounds: list[float] = field(default_factory=list)
    skipped: str | None = None
    order: list[int] = field(default_factory=list)
    round_ratios: list[float] = field(default_factory=list)
    ceiling_per_core: float | None = None
    decode_floor_per_core: float | None = None
    #: per round: images/s over that round's ceiling (the floors measured in the same round)
    ceiling_fractions: list[float] = field(default_factory=list)
    #: per round: images/s over one core's ceiling in that round times the workers (the ceiling before 2026-12-07)
    one_core_fractions: list[float] = field(default_factory=list)
    #: of the store it reads: the preset's loop in n processes at once over n x one alone (``Floors.together_share``)
    together_share: float | None = None


@dataclass(frozen=True, kw_only=True)
class Floors:
    """One store's floors per core (``store_floors``): medians of interleaved rounds, with the
    per-round ratio of the preset's cost to the decode's (min, median, max)."""

    decode_per_core: float  # images/s: the crop decoded as the preset decodes it, nothing else
    preset_per_core: float  # images/s: ``train_transform(size).from_bytes``, the whole per-image work
    normalise_ms: float  # one uint8 batch to normalised float32 (``fastload.normalize``, reused out), one thread
    batch_size: int
    preset_over_decode: tuple[float, float, float]
    #: images/s of ``together`` processes running the preset's loop at once, all of them (None: not measured)
    preset_together: float | None = None
    together: int = 1

    @property
    def decode_us(self) -> float:
        return 1e6 / self.decode_per_core

    @property
    def preset_us(self) -> float:
        return 1e6 / self.preset_per_core

    @property
    def normalise_us(self) -> float:
        """Normalisation per image."""
        return 1e3 * self.normalise_ms / self.batch_size

    def ceiling_per_core(self, uint8: bool) -> float:
        """Images/s one core can make of the work every path must do: the preset's, plus the
        normalisation unless the batches stay ``uint8``."""
        return self.preset_per_core if uint8 else 1e6 / (self.preset_us + self.normalise_us)

    @property
    def together_share(self) -> float | None:
        """The ``together`` processes at once against ``together`` x one alone (None: not measured)."""
        if self.preset_together is None:
            return None
        return self.preset_together / (self.together * self.preset_per_core)

    def ceiling(self, uint8: bool, workers: int) -> float:
        """Images/s ``workers`` cores' worth of processes can make of the work every path must do.

        With the preset's loop measured in that many processes at once (``preset_together``), each
        process's rate there, plus the normalisation of its image unless the batches stay ``uint8``;
        else one core's ``ceiling_per_core`` times them (a core that does not slow the other down).
        """
        n = max(1, workers)
        if self.preset_together is None or self.together != n:
            return self.ceiling_per_core(uint8) * n
        per = self.preset_together / n
        return n * (per if uint8 else 1e6 / (1e6 / per + self.normalise_us))

    @staticmethod
    def combine(rounds: list[Floors]) -> Floors:
        """The floors of several rounds: the median of each, and the spread of the per-round cost ratios."""
        med = statistics.median
        ratios = sorted(f.preset_over_decode[1] for f in rounds)
        together = [f.preset_together for f in rounds if f.preset_together is not None]
        return Floors(decode_per_core=med(f.decode_per_core for f in rounds),
                      preset_per_core=med(f.preset_per_core for f in rounds),
                      normalise_ms=med(f.normalise_ms for f in rounds), batch_size=rounds[0].batch_size,
                      preset_over_decode=(ratios[0], med(ratios), ratios[-1]),
                      preset_together=med(together) if together else None, together=rounds[0].together)


@dataclass
class LoaderBench:
    options: LoaderBenchOptions
    results: list[PathResult]
    ceiling_per_core: float | None  # of the full-resolution store: ``Floors.ceiling_per_core``
    environment: dict
    floors: Floors | None = None  # of the full-resolution store

    @property
    def baseline(self) -> float | None:
        return next((r.images_per_s for r in self.results if r.name == "torchvision"), None)

    @property
    def ceiling(self) -> float | None:
        """Of the full-resolution store: ``Floors.ceiling`` (the preset's loop in as many processes at once as
        there are workers, when measured), from the medians of the floors."""
        if self.floors is not None:
            return self.floors.ceiling(self.options.uint8, self.options.workers)
        return self.ceiling_per_core * max(1, self.options.workers) if self.ceiling_per_core else None

    @property
    def _together(self) -> bool:
        return self.floors is not None and self.floors.preset_together is not None

    def _of_ceiling(self, r: PathResult) -> float | None:
        """The median over the rounds of images/s over the ceiling measured in the same round."""
        if r.images_per_s is None or not r.ceiling_fractions:
            return None
        return float(statistics.median(r.ceiling_fractions))

    def _of_decode(self, r: PathResult) -> float | None:
        if r.images_per_s is None or r.decode_floor_per_core is None:
            return None
        # n cores at once: as much slower than n x one alone as the preset's processes at once were
        return r.images_per_s / (r.decode_floor_per_core * max(1, self.options.workers) * (r.together_share or 1.0))

    def table(self) -> str:
        o = self.options
        w = max(26, *(len(r.name) + 2 for r in self.results))
        step = (f"; a simulated step of {o.step_ms:g} ms after each batch, {o.host_ms:g} ms of it host CPU holding "
                "the GIL" if o.step_ms or o.host_ms else "")
        out = "uint8 batches (not normalised)" if o.uint8 else "normalised float32 batches"
        if o.channels_last:
            out += ", channels-last"
        lines = [f"batch {o.batch_size}, {o.workers} workers, {o.image_size}px crops, {out}, "
                 f"median of {o.rounds} rounds x {o.batches} batches (path order rotated each round, "
                 f"previous workers shut down first){step}",
                 f"{'path':<{w}}{'images/s':>10}{'vs torchvision':>16}{'per-round ratios':>22}{'of ceiling':>12}"
                 f"{'(per round)':>13}{'of decode':>11}" + (f"{'of n x 1 core':>15}" if self._together else "")]
        for r in self.results:
            if r.images_per_s is None:
                lines.append(f"{r.name:<{w}}{'skipped':>10}  {r.skipped}")
                continue
            ratio = f"{r.images_per_s / self.baseline:.2f}x" if self.baseline else "-"
            spread = ("-" if not r.round_ratios else
                      f"{min(r.round_ratios):.2f}-{max(r.round_ratios):.2f}x" if len(r.round_ratios) > 1 else
                      f"{r.round_ratios[0]:.2f}x")
            frac, dec = self._of_ceiling(r), self._of_decode(r)
            mark = "†" if r.name.startswith("fastload (threads, max-side") else " "
            fr = r.ceiling_fractions
            per = f"{min(fr):.0%}-{max(fr):.0%}" if fr else "-"
            one = "" if not self._together else (
                f"{statistics.median(r.one_core_fractions):>14.0%}{mark}" if r.one_core_fractions else f"{'-':>15}")
            lines.append((f"{r.name:<{w}}{r.images_per_s:>10.0f}{ratio:>16}{spread:>22}"
                          + (f"{frac:>11.0%}{mark}" if frac is not None else f"{'-':>12}") + f"{per:>13}"
                          + (f"{dec:>10.0%}{mark}" if dec is not None else f"{'-':>11}") + one).rstrip())
        f = self.floors
        if f is not None:
            lo, mid, hi = f.preset_over_decode
            lines.append(f"floors per core (full-resolution store, one thread, measured in every round beside "
                         f"the paths, medians): decode alone "
                         f"{f.decode_per_core:.0f} images/s ({f.decode_us:.0f} us/image, at the DCT scale or region "
                         f"the preset uses); the preset's whole work {f.preset_per_core:.0f} images/s "
                         f"({f.preset_us:.0f} us/image) = {mid:.2f}x the decode (per round {lo:.2f}-{hi:.2f}x); "
                         f"normalise a batch of {f.batch_size}: {f.normalise_ms:.2f} ms "
                         f"({f.normalise_us:.0f} us/image)")
            if f.preset_together is not None:
                lines.append(f"the preset's loop in {f.together} processes at once (the workers' count), measured in "
                             f"every round: {f.preset_together:.0f} images/s together = {f.together_share:.0%} of "
                             f"{f.together} x one alone (the medians' ratio)")
        if self.ceiling_per_core:
            what = "the preset floor" if o.uint8 else "the preset's work + normalising its image"
            n = max(1, o.workers)
            how = (f"{what}, in {n} processes at once: {self.ceiling:.0f} images/s (one core alone: "
                   f"{self.ceiling_per_core:.0f} x {n} = {self.ceiling_per_core * n:.0f}, the 'of n x 1 core' column)"
                   if self._together else f"{what}, {self.ceiling_per_core:.0f} images/s per core x {n} = "
                   f"{self.ceiling:.0f}")
            dec = (f"the decode floor x {n} x the share the preset's processes at once made of {n} x one alone"
                   if self._together else f"the decode floor x {n}")
            lines.append(f"ceiling: {how} (medians); 'of ceiling' is the median over the rounds of each round's "
                         f"images/s against that round's ceiling; 'of decode': against {dec}")
        reduced = next((r for r in self.results
                        if r.name.startswith("fastload (threads, max-side") and r.ceiling_per_core),
                       None)
        if reduced:
            lines.append(f"† different data: the max-side {o.max_side} store (ceiling "
                         f"{reduced.ceiling_per_core:.0f} images/s per core on it); its ratio is against torchvision "
                         "on the original files, the choice a user has")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"options": asdict(self.options), "environment": self.environment,
                "ceiling_per_core": self.ceiling_per_core, "ceiling": self.ceiling,
                "floors": None if self.floors is None else {**asdict(self.floors), "decode_us": self.floors.decode_us,
                                                            "preset_us": self.floors.preset_us,
                                                            "normalise_us": self.floors.normalise_us,
                                                            "together_share": self.floors.together_share},
                "paths": [{"name": r.name, "images_per_s": r.images_per_s, "rounds": r.rounds,
                           "round_order": r.order, "round_ratios": r.round_ratios,
                           "ratio": (r.images_per_s / self.baseline) if r.images_per_s and self.baseline else None,
                           "ceiling_per_core": r.ceiling_per_core,
                           "fraction_of_ceiling": self._of_ceiling(r),
                           "round_fractions_of_ceiling": r.ceiling_fractions,
                           "round_fractions_of_one_core_ceiling": r.one_core_fractions,
                           "decode_floor_per_core": r.decode_floor_per_core,
                           "fraction_of_decode_floor": self._of_decode(r),
                           "skipped": r.skipped} for r in self.results]}


def _forever(make_epoch: Callable[[], Iterable]) -> Iterator:
    while True:
        yield from make_epoch()


def _time(loader: Iterable, warmup: int, batches: int, step: Callable[[], object] | None = None,
          channels_last: bool = False) -> float:
    it = _forever(lambda: loader)
    if channels_last:  # every path ends in the same layout; a no-op for a batch already in it
        import torch

        it = ((images.contiguous(memory_format=torch.channels_last), *rest) for images, *rest in it)
    for _ in range(warmup):
        next(it)
        if step is not None:
            step()
    n = 0
    t0 = time.perf_counter()
    for images, _labels, *_ in itertools.islice(it, batches):
        n += len(images)
        if step is not None:
            step()
    return n / (time.perf_counter() - t0)


def _options(o: LoaderBenchOptions) -> StageOptions:
    return StageOptions(batch_size=o.batch_size, image_size=o.image_size, workers=o.workers, device="cpu",
                        pin_memory=False, uint8=o.uint8, channels_last=o.channels_last)


def _stage_path(stage_type: str, data: StageData, o: LoaderBenchOptions) -> Callable[[], BuiltStage]:
    return lambda: build_stage(stage_type, data, _options(o))


#: WebDataset sample keys for every extension the store accepts (``pack.sources.IMG_EXTENSIONS``).
def _wds_key(path: str) -> str:
    return Path(path).suffix.lower().lstrip(".").replace("jpeg", "jpg").replace("tiff", "tif")


def _webdataset_shards(data: Path, o: LoaderBenchOptions, tmp: Path) -> tuple[list[str], list[str]]:
    import webdataset as wds
    from torchvision.datasets import ImageFolder

    folder = ImageFolder(str(data))
    n_shards = max(2 * max(1, o.workers), 4)
    per = -(-len(folder.samples) // n_shards)
    urls, keys = [], set()
    for s in range(n_shards):
        url = str(tmp / f"shard-{s:04d}.tar")
        with wds.TarWriter(url) as sink:
            for k, (path, label) in enumerate(folder.samples[s * per:(s + 1) * per]):
                ext = _wds_key(path)
                keys.add(ext)
                sink.write({"__key__": f"{s:04d}{k:06d}", ext: Path(path).read_bytes(), "cls": label})
        urls.append(url)
    return urls, sorted(keys)


def _make_webdataset(urls: list[str], keys: list[str], o: LoaderBenchOptions) -> BuiltStage:
    import webdataset as wds

    from fastload.measure.stages import torchvision_train_transform

    tf = torchvision_train_transform(o.image_size, uint8=o.uint8)
    wanted = ";".join(sorted(set(keys) | {_wds_key(f"x{e}") for e in IMG_EXTENSIONS}))
    dataset = (wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False).shuffle(500)
               .decode("pil").to_tuple(wanted, "cls").map_tuple(tf, lambda c: c)
               .batched(o.batch_size, partial=False))
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=o.workers, persistent_workers=o.workers > 0)
    return BuiltStage("webdataset", loader, o.workers, "workers (torchvision PILToTensor, uint8)" if o.uint8
                      else "workers (torchvision ToTensor + Normalize)")


def _ffcv_beton(data: Path, o: LoaderBenchOptions, tmp: Path) -> str:
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter
    from torchvision.datasets import ImageFolder

    beton = str(tmp / "data.beton")
    writer = DatasetWriter(beton, {"image": RGBImageField(write_mode="jpg", max_resolution=10_000),
                                   "label": IntField()}, num_workers=max(1, o.workers))
    writer.from_indexed_dataset(ImageFolder(str(data)))
    return beton


def _make_ffcv(beton: str, o: LoaderBenchOptions) -> BuiltStage:
    """FFCV's own ImageNet recipe on a .beton of the same files: RandomResizedCrop decoder, flip."""
    import numpy as np
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import NormalizeImage, RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage

    from fastload.load.transforms import IMAGENET_MEAN, IMAGENET_STD

    mean = np.array(IMAGENET_MEAN) * 255
    std = np.array(IMAGENET_STD) * 255
    pipelines = {
        "image": [RandomResizedCropRGBImageDecoder((o.image_size, o.image_size)), RandomHorizontalFlip(),
                  NormalizeImage(mean, std, np.float32), ToTensor(), ToTorchImage()],
        "label": [IntDecoder(), ToTensor(), Squeeze()],
    }
    loader = Loader(beton, batch_size=o.batch_size, num_workers=max(1, o.workers), order=OrderOption.RANDOM,
                    drop_last=True, pipelines=pipelines, os_cache=True)
    return BuiltStage("ffcv", loader, max(1, o.workers), "FFCV pipeline (NormalizeImage)")


# the records the floors run on: the store's first FLOOR_RECORDS, fewer when they pass FLOOR_BYTES, cycled to as
# many crops as a path's round takes (``bench loader``: batches x batch size, 30 x 64 = 1,920 by default;
# FLOOR_CROPS where no round says, as in tools/bench_ceiling.py), each drawn afresh. The preset's cost per image
# moves with its crop (a large crop of a small photo is a region decode, a small one a DCT-scaled decode), so a
# floor must average as many crops as a path's round does, not a few whose luck sets the ceiling; and no more, or
# a store of 12 MP photos (38 ms per image for a 4000 x 3000 JPEG here) spends minutes per round on floors for a
# round of seconds
# (docs/loader.md, "The floors on as many crops as the paths")
FLOOR_RECORDS = 1024
FLOOR_BYTES = 64 << 20
FLOOR_CROPS = 2048


def floor_records(ds) -> list[bytes]:
    """The encoded records the floors time: ``ds``'s first ``FLOOR_RECORDS``, fewer past ``FLOOR_BYTES`` (at least one).

    Raises:
        ValueError: the store holds no records (nothing to time).
    """
    if len(ds) == 0:
        raise ValueError(f"{getattr(ds, 'root', ds)}: the store holds no records, so it has no floors to time")
    blobs: list[bytes] = []
    total = 0
    for i in range(min(len(ds), FLOOR_RECORDS)):
        if blobs and total >= FLOOR_BYTES:
            break
        blobs.append(ds.get_bytes(i))
        total += len(blobs[-1])
    return blobs


def floor_crops(records: list[bytes], crops: int | None = None) -> list[bytes]:
    """``records`` cycled to ``crops`` items (default ``FLOOR_CROPS``; the first ``crops`` records when there are
    more): one crop is drawn per item.

    Raises:
        ValueError: ``crops`` < 1.
    """
    crops = FLOOR_CROPS if crops is None else crops
    if crops < 1:
        raise ValueError(f"the floors need at least one crop, got {crops}")
    return [records[k % len(records)] for k in range(crops)]


def preset_passes(tf, blobs: list[bytes], generator, seconds: float, seed: int = 0) -> tuple[int, float, float]:
    """The preset floor's loop: whole passes of ``tf.from_bytes`` over ``blobs`` for at least ``seconds``, each pass
    reseeding ``generator`` with ``seed`` so every pass draws the same crops (those ``tf.draw`` makes in order from
    that seed). Returns ``(images, start, end)`` on the system-wide monotonic clock: one process's rate, or, from
    several processes at once, one window (``together_rate``)."""
    n, t0 = 0, time.monotonic()
    while n == 0 or time.monotonic() - t0 < seconds:
        generator.manual_seed(seed)
        for b in blobs:
            tf.from_bytes(b, generator)
        n += len(blobs)
    return n, t0, time.monotonic()


def _preset_process(store: str, size: int, channels_last: bool, crops: int | None, conn) -> None:
    """One of ``PresetProcesses``: the preset floor's loop over ``floor_crops``, each time the bench asks.

    Answers ``(images, start, end)`` on the system-wide monotonic clock, so the bench can hold all the
    processes' images to one window."""
    try:
        import torch

        from fastload.load.dataset import LMDBImageDataset
        from fastload.load.transforms import train_transform

        tf = train_transform(size, channels_last=channels_last)
        blobs = floor_crops(floor_records(LMDBImageDataset(store)), crops)
        g = torch.Generator()
        with one_torch_thread():
            for b in blobs[:8]:  # warm up: the decoders' first calls
                tf.from_bytes(b, g)
            conn.send(("ready", None))
            while (seconds := conn.recv()) is not None:  # the crops the one-thread preset floor draws
                conn.send(("rate", preset_passes(tf, blobs, g, seconds)))
    except (EOFError, KeyboardInterrupt):  # the bench is gone or interrupted: nothing to report to
        return
    except BaseException as exc:  # noqa: BLE001 - reported to the bench, which raises it by name
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def together_rate(answers: list[tuple[int, float, float]]) -> float:
    """Images/s of processes run at once: all their images over the one window from the first start to the last end.

    Not the sum of each one's rate: one that ends early leaves the others the cores for the rest of their loop,
    and their rates then would count that time as if all were still running."""
    return sum(n for n, _, _ in answers) / (max(e for _, _, e in answers) - min(s for _, s, _ in answers))


class PresetProcesses:
    """``n`` processes that run the preset floor's loop at once, when asked (``rate``).

    A path's ``n`` workers run on ``n`` cores at once, and cores running at once slow each other
    down (shared caches and memory bandwidth, clocks, a virtual machine's host): ``n`` times one
    core alone is a ceiling no path can reach. Each process runs the one-thread preset floor's
    loop (``floor_crops`` of ``store``, the same crops each pass) under the bench's CPU affinity, so
    ``rate`` is what ``n`` processes doing only the preset's work make together. Between calls they
    wait on a pipe, using no CPU, so they can stay up while the paths are timed.

    They are started from the fork server (``multiprocessing``'s ``forkserver``), not forked from the
    bench: LMDB refuses to open an environment a forked process inherited open. When no fork server
    runs yet, this module is added to its preload list, so torch is imported once, not once per
    process. Like any process that start method makes, they import the script that called the bench:
    a script calling ``bench_loader`` must guard its top level with ``if __name__ == "__main__":``.

    Raises:
        RuntimeError: a process could not start its loop, or gave no sign of life within ``TIMEOUT`` of
            starting (the message names the store and why).
    """

    #: seconds a process may take to start (import, read the records, warm up) before the bench fails by name
    TIMEOUT = 900

    def __init__(self, store: Path, size: int, n: int, *, channels_last: bool = False,
                 crops: int | None = None) -> None:
        import multiprocessing as mp

        if "forkserver" in mp.get_all_start_methods():
            ctx = mp.get_context("forkserver")
            _preload_this_module()
        else:
            ctx = mp.get_context("spawn")
        self.store, self.n = Path(store), n
        self._conns, self._procs = [], []
        try:
            for _ in range(n):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=_preset_process, args=(str(store), size, channels_last, crops, theirs),
                                   name="fastload-bench-preset-floor", daemon=True)
                proc.start()
                theirs.close()
                self._conns.append(ours)
                self._procs.append(proc)
            self._replies(self.TIMEOUT)
        except BaseException:
            self.close(terminate=True)
            raise

    def _replies(self, timeout: float | None) -> list:
        out = []
        for conn, proc in zip(self._conns, self._procs):
            try:
                if timeout is not None and not conn.poll(timeout):
                    raise RuntimeError(f"{self.store}: the preset floor's process did not start in {timeout:g} s")
                kind, value = conn.recv()
            except EOFError:
                proc.join(timeout=5)
                kind, value = "error", (f"the process exited (code {proc.exitcode}) without a word; a script that "
                                        "calls the bench must guard its top level with if __name__ == '__main__':")
            if kind == "error":
                raise RuntimeError(f"{self.store}: the preset floor's process failed: {value}")
            out.append(value)
        return out

    def rate(self, seconds: float) -> float:
        """Images/s of the ``n`` loops run at once, each for at least ``seconds`` in whole passes
        (``together_rate``: all their images over one window)."""
        for conn in self._conns:
            conn.send(seconds)
        return together_rate(self._replies(None))

    def close(self, *, terminate: bool = False) -> None:
        """Let the processes end (each finishes the loop it is in), or with ``terminate`` stop them now."""
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 30
        for proc in self._procs:
            if not terminate:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []

    def __enter__(self) -> PresetProcesses:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(terminate=exc_type is not None)  # on an error or an interrupt: at once, not after their loops


def _preload_this_module() -> None:
    """Add this module to the fork server's preload list, unless a fork server already runs (then it has no
    effect): the caller's own preload modules are kept."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None:
        return
    mods = list(getattr(server, "_preload_modules", None) or ["__main__"])
    if __name__ not in mods:
        server.set_forkserver_preload(mods + [__name__])


def single_core_ceiling(store: Path, size: int, seconds: float = 2.0) -> float:
    """Images/s of a tight ``train_transform(size).from_bytes`` loop, one thread, over ``floor_records``."""
    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.transforms import train_transform

    ds = LMDBImageDataset(store)
    tf = train_transform(size)
    blobs = floor_records(ds)
    with one_torch_thread():
        for b in blobs[:16]:
            tf.from_bytes(b)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for b in blobs:
                tf.from_bytes(b)
            n += len(blobs)
        return n / (time.perf_counter() - t0)


def store_floors(store: Path, size: int, batch_size: int, *, seconds: float = 1.0, rounds: int = 3,
                 channels_last: bool = False, together: PresetProcesses | None = None,
                 crops: int | None = None) -> Floors:
    """The floors per core of ``store`` (``Floors``): tight one-thread loops, in interleaved rounds.

    The records are ``floor_records`` (the store's first ``FLOOR_RECORDS``), cycled to ``crops``
    crops (default ``FLOOR_CROPS``; ``bench loader`` passes a path's round, batches x batch size), each
    drawn afresh, so the floor is not set by the luck of a few. Decode alone decodes each crop
    ``train_transform(size)`` draws (drawn once beforehand, seed 0) exactly as the preset does
    (``decode_crop``); the preset floor runs ``from_bytes`` on the same records with the same draws;
    normalisation times ``normalize`` on one ``uint8`` batch of ``batch_size`` x 3 x ``size`` x
    ``size``, into one reused output (``DevicePrefetcher``'s case once a batch is dropped: no fresh
    pages to fault in). ``channels_last``: the preset with ``channels_last=True``, the batch and its
    output channels-last. ``together``: also the preset's loop
    in its processes at once, as another arm of the rounds (``Floors.preset_together``).
    """
    import torch

    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.transforms import normalize, train_transform

    ds = LMDBImageDataset(store)
    tf = train_transform(size, channels_last=channels_last)
    blobs = floor_crops(floor_records(ds), crops)
    g = torch.Generator().manual_seed(0)
    drawn = [tf.draw(b, g) for b in blobs]
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    batch = torch.randint(0, 256, (batch_size, 3, size, size), dtype=torch.uint8, generator=g)
    batch = batch.contiguous(memory_format=fmt)
    out = torch.empty(batch.shape, dtype=torch.float32, memory_format=fmt)

    gp = torch.Generator()

    def loop(one: Callable[[int], object], items: int) -> float:
        n, t0 = 0, time.perf_counter()
        while n == 0 or time.perf_counter() - t0 < seconds:
            for k in range(items):
                one(k)
            n += items
        return n / (time.perf_counter() - t0)

    arms: dict[str, Callable[[], float]] = {
        "decode": lambda: loop(lambda k: tf.decode_crop(blobs[k], drawn[k]), len(blobs)),
        # each pass draws the crops ``drawn`` holds (seed 0), as the processes at once do
        "preset": lambda: together_rate([preset_passes(tf, blobs, gp, seconds)]),
        "normalise": lambda: loop(lambda k: normalize(batch, channels_last=channels_last, out=out), 1),
    }
    if together is not None:
        arms["together"] = lambda: together.rate(seconds)
    with one_torch_thread():
        for b, d in zip(blobs[:8], drawn[:8]):  # warm up, once: the decoders' first calls
            tf.decode_crop(b, d)
            tf.from_bytes(b, gp)
        normalize(batch, channels_last=channels_last, out=out)  # and the output's pages, faulted in
        res = interleave(list(arms), rounds, lambda name, k: arms[name]())
    dec, pre = res["decode"], res["preset"]
    ratios = sorted(d / p for d, p in zip(dec.values, pre.values))  # decode rate / preset rate = cost ratio
    return Floors(decode_per_core=dec.median(), preset_per_core=pre.median(),
                  normalise_ms=1e3 / res["normalise"].median(), batch_size=batch_size,
                  preset_over_decode=(ratios[0], ratios[len(ratios) // 2], ratios[-1]),
                  preset_together=res["together"].median() if together is not None else None,
                  together=together.n if together is not None else 1)


ALL_PATHS = ("torchvision", "fastload", "fastload-threads", "fastload-reduced", "webdataset", "dali-cpu", "spdl",
             "ffcv")


def _display(name: str, o: LoaderBenchOptions) -> str:
    if name == "fastload-threads":
        return "fastload (threads)"
    if name != "fastload-reduced":
        return name
    encoding = "" if o.reduced_encoding == "jpeg" else f", {o.reduced_encoding}"
    return f"fastload (threads, max-side {o.max_side}{encoding})"


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"failed on this data: {type(exc).__name__}: {text[0] if text else ''}"[:300]


def bench_loader(data: str | Path, *, store: str | Path | None = None,
                 options: LoaderBenchOptions = LoaderBenchOptions(), progress: bool = True) -> LoaderBench:
    """Time every loading path over ImageFolder ``data`` (packed to a temporary store if no ``store``).

    Raises:
        ValueError: an unknown path name.
    """
    from fastload.measure.env import environment
    from fastload.pack.convert import ConvertOptions, convert
    from fastload.progress import bar
    from fastload.system import DALI_INSTALL_HINT, dali_available

    data = Path(data)
    o = options
    step = None
    if o.step_ms or o.host_ms:
        from fastload.measure.train import SimulatedStep

        step = SimulatedStep(o.step_ms, o.host_ms).run
    wanted = o.paths or ALL_PATHS
    unknown = set(wanted) - set(ALL_PATHS)
    if unknown:
        raise ValueError(f"Unknown path(s) {sorted(unknown)}. Valid values are {list(ALL_PATHS)}.")
    with tempfile.TemporaryDirectory(prefix="fastload-bench-") as tmpdir:
        tmp = Path(tmpdir)
        if store is None:
            store = tmp / "store.lmdb"
            convert(data, store, ConvertOptions(progress=progress))
        store = Path(store)
        full = StageData(data, store)
        builders: dict[str, Callable[[], BuiltStage]] = {}
        stores: dict[str, Path] = {}
        results: dict[str, PathResult] = {}

        def add(name: str, prepare: Callable[[], Callable[[], BuiltStage]], *, missing: str | None = None,
                reads: Path | None = None) -> None:
            if name not in wanted:
                return
            results[name] = PathResult(_display(name, o), None, skipped=missing)
            if missing:
                return
            try:
                builders[name] = prepare()
            except Exception as exc:  # a path that cannot run on this data is skipped, the others go on
                results[name].skipped = _reason(exc)
                return
            if reads is not None:
                stores[name] = reads

        add("torchvision", lambda: _stage_path("workers", full, o), reads=store)
        add("fastload", lambda: _stage_path("fast", full, o), reads=store)
        add("fastload-threads", lambda: _stage_path("threads", full, o), reads=store)
        reduced = tmp / "reduced.lmdb"

        def prep_reduced() -> Callable[[], BuiltStage]:
            convert(data, reduced, ConvertOptions(max_side=o.max_side, encoding=o.reduced_encoding, progress=progress))
            return _stage_path("threads", StageData(data, reduced), o)

        add("fastload-reduced", prep_reduced, reads=reduced, missing=None if o.max_side else "needs --max-side N")
        has_wds = importlib.util.find_spec("webdataset") is not None

        def prep_wds() -> Callable[[], BuiltStage]:
            urls, keys = _webdataset_shards(data, o, tmp)
            return lambda: _make_webdataset(urls, keys, o)

        add("webdataset", prep_wds, reads=store, missing=None if has_wds else
            "webdataset is not installed (pip install 'fastload[bench]')")
        add("dali-cpu", lambda: _stage_path("dali-cpu", full, o), reads=store,
            missing=None if dali_available() else "DALI is not installed: " + DALI_INSTALL_HINT)

        def prep_spdl() -> Callable[[], BuiltStage]:
            samples = _spdl.folder_samples(data)  # the files and labels torchvision reads
            return lambda: _spdl.spdl_stage(samples, batch_size=o.batch_size, image_size=o.image_size,
                                            workers=o.workers, uint8=o.uint8,
                                            channels_last=o.channels_last)

        add("spdl", prep_spdl, reads=store, missing=_spdl.unavailable() if "spdl" in wanted else None)

        def prep_ffcv() -> Callable[[], BuiltStage]:
            beton = _ffcv_beton(data, o, tmp)
            return lambda: _make_ffcv(beton, o)

        add("ffcv", prep_ffcv, reads=store, missing="not run with uint8 batches (its recipe normalises)" if o.uint8
            else None if importlib.util.find_spec("ffcv") else
            "ffcv is not importable (it needs libopencv-dev, libturbojpeg0-dev, pkg-config, then pip install ffcv)")
        order: list[str] = [n for n in ALL_PATHS if n in builders]
        # the floors are arms of the rounds too: a shared machine's speed moves between minutes, and a path is
        # held to the ceiling measured in its own round, not to one measured before or after all of them
        floor_arms = {f"floors {p}": p for p in dict.fromkeys(stores.values())}
        order += list(floor_arms)
        # with n workers, the preset's loop also runs in n processes at once: the ceiling of n cores busy together
        together: dict[Path, PresetProcesses] = {}
        crops = o.batches * o.batch_size  # the floors time as many crops as a path's round
        procs = contextlib.ExitStack()

        def measure(name: str, k: int) -> float | Floors | None:
            pbar.update()
            if name in floor_arms:
                path = floor_arms[name]
                if o.workers > 1 and path not in together:
                    together[path] = procs.enter_context(PresetProcesses(path, o.image_size, o.workers,
                                                                         channels_last=o.channels_last, crops=crops))
                return store_floors(path, o.image_size, o.batch_size, seconds=o.floor_seconds, rounds=1,
                                    channels_last=o.channels_last, together=together.get(path), crops=crops)
            if results[name].skipped:
                return None
            try:
                with running(builders[name]()) as loader:
                    return _time(loader, o.warmup, o.batches, step, o.channels_last)
            except Exception as exc:
                results[name].skipped = _reason(exc)
                return None

        with procs, bar(total=o.rounds * len(order), desc="bench loader", disable=not progress) as pbar:
            arms = interleave(order, o.rounds, measure)
        ordered = []
        base = arms.get("torchvision") if "torchvision" in arms and not results["torchvision"].skipped else None
        for name in ALL_PATHS:
            if name not in results:
                continue
            r = results[name]
            arm = arms.get(name)
            if arm is not None and arm.values and not r.skipped:
                r.rounds, r.order = arm.values, arm.rounds
                r.images_per_s = arm.median()
                if base is not None and base.values:
                    r.round_ratios = arm.ratios_to(base)
            ordered.append(r)
        floors: dict[Path, Floors] = {p: Floors.combine(arms[a].values) for a, p in floor_arms.items()
                                      if arms[a].values}
        for name, path in stores.items():
            r = results[name]
            if r.images_per_s is None or path not in floors:
                continue
            r.ceiling_per_core = floors[path].ceiling_per_core(o.uint8)
            r.decode_floor_per_core = floors[path].decode_per_core
            r.together_share = floors[path].together_share
            by_round = dict(zip(arms[f"floors {path}"].rounds, arms[f"floors {path}"].values))
            r.ceiling_fractions = [v / by_round[k].ceiling(o.uint8, o.workers)
                                   for v, k in zip(r.rounds, r.order) if k in by_round]
            r.one_core_fractions = [v / (by_round[k].ceiling_per_core(o.uint8) * max(1, o.workers))
                                    for v, k in zip(r.rounds, r.order) if k in by_round]
    full_floors = floors.get(store)
    return LoaderBench(o, ordered, full_floors.ceiling_per_core(o.uint8) if full_floors else None, environment(),
                       full_floors)
