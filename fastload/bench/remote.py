"""``fastload bench loader --remote URL``: a store in object storage against the same store on local disk.

Owns: timing one loader over the same sharded store read three ways, in interleaved rounds:
``local`` (the folder of shards on this disk), ``remote-cold`` (the bucket, through an empty
node cache) and ``remote-warm`` (the bucket, through a cache that already holds the store).
Each is ``fastload.DataLoader`` with the same ``ShardSampler`` order, batch size, workers and
eval preset, one whole epoch per round. Reported per path: images/s (median of the rounds, and
each round's ratio to ``local`` in that round), time to first batch, and bytes the node
downloaded in the epoch (from the cache's own log, all processes).

With ``mosaic_url`` (the same images written by MosaicML Streaming's ``MDSWriter`` to the same
server, columns ``image: bytes`` and ``label: int``; ``write_mds`` writes it), two more paths:
``mosaic-cold`` and ``mosaic-warm``, ``streaming.StreamingDataset`` (its default shuffle) through
torch's ``DataLoader`` with the same workers, batch size and eval transform (decode with PIL,
as its users do). Its "downloaded" column is the bytes of its local cache after the epoch (cold)
or 0 (warm: nothing was missing).

Must not: assert on timings, or start a server (point ``AWS_ENDPOINT_URL`` at one).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["RemoteBenchOptions", "RemotePath", "RemoteBench", "bench_remote"]

PATHS = ("local", "remote-cold", "remote-warm")
MOSAIC_PATHS = ("mosaic-cold", "mosaic-warm")


@dataclass(frozen=True, kw_only=True)
class RemoteBenchOptions:
    """What to run: loader settings shared by every path, and how many rounds."""

    workers: int = 2
    batch_size: int = 64
    image_size: int = 128
    rounds: int = 3
    backend: str = "processes"

    def __post_init__(self) -> None:
        if self.workers < 0 or self.batch_size < 1 or self.image_size < 8 or self.rounds < 1:
            raise ValueError(f"invalid RemoteBenchOptions: {self}")


@dataclass
class RemotePath:
    name: str
    images_per_s: list[float] = field(default_factory=list)
    first_batch_s: list[float] = field(default_factory=list)
    downloaded: list[int] = field(default_factory=list)
    ratio_to_local: list[float] = field(default_factory=list)



def _drain(loader, t0: float) -> tuple[int, float | None, float]:
    """Read every batch: (images, seconds to the first batch, seconds in all), both from ``t0``."""
    n, first = 0, None
    for x, _y in loader:
        if first is None:
            first = time.perf_counter() - t0
        n += len(x)
    return n, first, time.perf_counter() - t0

def _epoch(dataset_args: tuple, o: RemoteBenchOptions, cache_dir: Path | None) -> tuple[float, float, int, int]:
    import torch

    import fastload
    from fastload.load.shards import ShardSampler
    from fastload.store.cache import node_downloads

    path = dataset_args[0]
    kw = {"cache_dir": cache_dir} if cache_dir is not None else {}
    before = len(node_downloads(cache_dir)) if cache_dir is not None else 0
    t0 = time.perf_counter()
    ds = fastload.LMDBImageDataset(path, transform=fastload.eval_transform(size=o.image_size), **kw)
    loader = fastload.DataLoader(ds, batch_size=o.batch_size, num_workers=o.workers, backend=o.backend,
                                 sampler=ShardSampler(ds, seed=0), generator=torch.Generator().manual_seed(0))
    n, first, total = _drain(loader, t0)
    got = sum(d["bytes"] for d in node_downloads(cache_dir)[before:]) if cache_dir is not None else 0
    return n / total, first or 0.0, got, n


def write_mds(store: str | Path, out: str, *, size_limit: int | str = 1 << 22) -> int:
    """Write every sample of the local ``store`` (its stored bytes and label) as MosaicML MDS to ``out``
    (a local folder or ``s3://`` URL: ``streaming`` uploads it, endpoint from ``S3_ENDPOINT_URL``). Returns
    the samples written."""
    from streaming import MDSWriter

    import fastload

    ds = fastload.LMDBImageDataset(store)
    with MDSWriter(out=out, columns={"image": "bytes", "label": "int"}, size_limit=size_limit) as w:
        for i in range(len(ds)):
            w.write({"image": ds.get_bytes(i), "label": int(ds.targets[i])})
    return len(ds)


def _mosaic_dataset(o: RemoteBenchOptions):
    import io

    from PIL import Image
    from streaming import StreamingDataset

    import fastload

    transform = fastload.eval_transform(size=o.image_size)

    class _Images(StreamingDataset):
        def __getitem__(self, index):
            s = super().__getitem__(index)
            with Image.open(io.BytesIO(s["image"])) as im:
                return transform(im.convert("RGB")), s["label"]

    return _Images


def _mosaic_epoch(url: str, o: RemoteBenchOptions, local: Path) -> tuple[float, float, int, int]:
    import torch
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    cold = not local.exists()
    t0 = time.perf_counter()
    ds = _mosaic_dataset(o)(remote=url, local=str(local), shuffle=True, shuffle_seed=0, batch_size=o.batch_size)
    # torch's DataLoader, as MosaicML Streaming's docs use it
    loader = torch.utils.data.DataLoader(ds, batch_size=o.batch_size, num_workers=o.workers)
    n, first, total = _drain(loader, t0)
    del loader, ds
    got = sum(f.stat().st_size for f in local.rglob("*.mds")) if cold else 0
    return n / total, first or 0.0, got, n


class RemoteBench:
    """The result: ``table()`` for people, ``to_json()`` for files."""

    def __init__(self, data: dict) -> None:
        self.data = data

    def to_json(self) -> dict:
        return self.data

    def table(self) -> str:
        return table(self.data)


def bench_remote(local: str | Path, url: str, options: RemoteBenchOptions | None = None, *,
                 mosaic_url: str | None = None) -> RemoteBench:
    """Time ``local`` (a folder of shards) against ``url`` (the same store in a bucket), and against
    ``mosaic_url`` (the same images as MosaicML MDS) when given; see the module docstring."""
    o = options or RemoteBenchOptions()
    work = Path(tempfile.mkdtemp(prefix="fastload-bench-remote-"))
    warm = work / "warm"
    paths = PATHS + (MOSAIC_PATHS if mosaic_url else ())
    try:
        _epoch((url,), o, warm)  # fills the warm cache (not timed)
        if mosaic_url:
            _mosaic_epoch(mosaic_url, o, work / "mosaic-warm")
        results = {p: RemotePath(p) for p in paths}
        for k in range(o.rounds):
            order = paths[k % len(paths):] + paths[: k % len(paths)]
            this = {}
            for p in order:
                if p == "mosaic-cold":
                    r = _mosaic_epoch(mosaic_url, o, work / f"mosaic-cold{k}")
                    shutil.rmtree(work / f"mosaic-cold{k}", ignore_errors=True)
                elif p == "mosaic-warm":
                    r = _mosaic_epoch(mosaic_url, o, work / "mosaic-warm")
                elif p == "local":
                    r = _epoch((str(local),), o, None)
                elif p == "remote-cold":
                    cold = work / f"cold{k}"
                    r = _epoch((url,), o, cold)
                    shutil.rmtree(cold, ignore_errors=True)
                else:
                    r = _epoch((url,), o, warm)
                this[p] = r
                results[p].images_per_s.append(r[0])
                results[p].first_batch_s.append(r[1])
                results[p].downloaded.append(r[2])
            for p in paths:
                results[p].ratio_to_local.append(this[p][0] / this["local"][0])
        return RemoteBench({"options": asdict(o), "url": url, "local": str(local),
                "paths": {p: {"images_per_s_median": statistics.median(r.images_per_s),
                              "ratio_to_local": r.ratio_to_local,
                              "first_batch_s_median": statistics.median(r.first_batch_s),
                              "bytes_downloaded_per_epoch": r.downloaded, "images_per_s": r.images_per_s}
                          for p, r in results.items()}})
    finally:
        shutil.rmtree(work, ignore_errors=True)


def table(result: dict) -> str:
    rows = [f"{'path':14s} {'images/s':>9s} {'vs local (per round)':>28s} {'first batch':>12s} "
            f"{'downloaded/epoch':>17s}"]
    for p, r in result["paths"].items():
        ratios = " ".join(f"{x:.2f}" for x in r["ratio_to_local"])
        rows.append(f"{p:14s} {r['images_per_s_median']:>9.0f} {ratios:>28s} {r['first_batch_s_median']:>11.2f}s "
                    f"{statistics.median(r['bytes_downloaded_per_epoch']) / 1e6:>14.1f} MB")
    return "\n".join(rows)
