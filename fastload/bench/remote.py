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
as its users do). Its "downloaded" column is the bytes of the cache files the epoch wrote (new or
rewritten shard files), cold or warm.

With ``litdata_url`` (the same images written by LitData's ``optimize()`` in its own chunk format
to the same server, items ``{"image": bytes, "label": int}``; ``write_litdata`` writes it), two
more: ``litdata-cold`` and ``litdata-warm``, ``litdata.StreamingDataset`` (``shuffle=True``,
``seed=0``) through its ``StreamingDataLoader``, with the same workers, batch size, PIL decode and
eval transform as the MosaicML path; "downloaded" is likewise the bytes of the chunk files the
epoch wrote into its cache. Each LitData epoch runs in a fresh (spawned) process, timed from inside it: its
workers download chunks with obstore, whose runtime does not survive ``fork()`` once this process
has used it (the fastload paths have), and LitData only knows about its own use of it.

With ``dali=True``, three more: ``dali-local``, ``dali-cold`` and ``dali-warm``, ``fastload.DALILoader`` on
the CPU (``device="cpu"``, ``num_threads`` = workers, eval pipeline at ``image_size``) over the same
local shards read by shards (``order="shards"``) and over the URL (by shards, its default) through an
empty or a filled node cache. Their ratio column is to ``dali-local`` in the same round, and their
batch contract (DALI hands out float normalised images) is compared among the DALI paths only;
"first batch" also gives the loader's own ``time_to_first_batch`` (from ``iter()``).

With ``link`` (an object with ``rate`` in bytes/s, ``mark()`` and ``traffic() -> (bytes, first, last)``
as ``time.monotonic()``: the throttled proxy of ``tools/bench_remote_loopback.py --link-mbps``, which
every remote path reaches the server through), each remote epoch also reports the bytes the link
carried towards this node and the share of the link they used: over the whole epoch
(``bytes / epoch seconds / rate``) and while downloading (``bytes / (last byte - first byte) / rate``).

Must not: assert on timings, or start a server (point ``AWS_ENDPOINT_URL`` at one).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["RemoteBenchOptions", "RemotePath", "RemoteBench", "bench_remote", "write_mds", "write_litdata"]

PATHS = ("local", "remote-cold", "remote-warm")
MOSAIC_PATHS = ("mosaic-cold", "mosaic-warm")
LITDATA_PATHS = ("litdata-cold", "litdata-warm")
DALI_PATHS = ("dali-local", "dali-cold", "dali-warm")


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
    images: list[int] = field(default_factory=list)
    batch: set[str] = field(default_factory=set)
    loader_first_batch_s: list[float] = field(default_factory=list)
    link: list[dict] = field(default_factory=list)


#: One timed epoch: images/s, seconds to the first batch, bytes downloaded, images, the batch contract
#: (and, for the DALI paths, the loader's own ``time_to_first_batch`` as a sixth element).
Epoch = tuple


def _drain(loader, t0: float, downloaded: Callable[[], int]) -> Epoch:
    """Read every batch, timed from ``t0``; ``downloaded()`` is asked after the last one. The batch
    contract is the first batch's ``"images dtype [C, H, W], labels dtype"``, compared across paths."""
    n, first, contract = 0, None, ""
    for x, y in loader:
        if first is None:
            first = time.perf_counter() - t0
            contract = f"{x.dtype} {list(x.shape[1:])}, {y.dtype}"
        n += len(x)
    total = time.perf_counter() - t0
    return n / total, first or 0.0, downloaded(), n, contract


def _epoch(dataset_args: tuple, o: RemoteBenchOptions, cache_dir: Path | None) -> Epoch:
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
    return _drain(loader, t0, lambda: sum(d["bytes"] for d in node_downloads(cache_dir)[before:])
                  if cache_dir is not None else 0)


def _dali_epoch(source: str, o: RemoteBenchOptions, cache_dir: Path | None) -> Epoch:
    """One epoch of ``DALILoader`` on the CPU, by shards, timed from building it (as ``_epoch``)."""
    from fastload.dali import DALILoader, DALIOptions
    from fastload.store.cache import node_downloads

    before = len(node_downloads(cache_dir)) if cache_dir is not None else 0
    t0 = time.perf_counter()
    opts = DALIOptions(order="shards", **({"cache_dir": str(cache_dir)} if cache_dir is not None else {}))
    loader = DALILoader(source, o.batch_size, train=False, size=o.image_size, device="cpu",
                        num_threads=max(1, o.workers), seed=0, options=opts)
    try:
        r = _drain(loader, t0, lambda: sum(d["bytes"] for d in node_downloads(cache_dir)[before:])
                   if cache_dir is not None else 0)
        return (*r, loader.time_to_first_batch)
    finally:
        loader.close()


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


def _litdata_item(item: tuple[bytes, int]) -> dict:
    """What ``optimize()`` stores per sample (module level: its workers are spawned)."""
    return {"image": item[0], "label": item[1]}


def write_litdata(store: str | Path, out: str, *, chunk_bytes: int | str = 1 << 22) -> int:
    """Write every sample of the local ``store`` (its stored bytes and label) with LitData's ``optimize()``
    (its own chunk format, one worker, the store's order) to ``out`` (a local folder or ``s3://`` URL:
    LitData's boto3 client takes the endpoint from ``AWS_ENDPOINT_URL``). Its staging folder is a
    temporary one, removed after. Returns the samples written."""
    import multiprocessing
    import os

    from litdata import optimize

    import fastload

    ds = fastload.LMDBImageDataset(store)
    items = [(ds.get_bytes(i), int(ds.targets[i])) for i in range(len(ds))]
    staging = tempfile.mkdtemp(prefix="fastload-litdata-")
    saved = {k: os.environ.get(k) for k in ("DATA_OPTIMIZER_CACHE_FOLDER", "DATA_OPTIMIZER_DATA_CACHE_FOLDER",
                                            "AWS_ALLOW_HTTP")}
    os.environ.update(DATA_OPTIMIZER_CACHE_FOLDER=f"{staging}/chunks",
                      DATA_OPTIMIZER_DATA_CACHE_FOLDER=f"{staging}/data", **_litdata_http())
    # optimize() sets this process's start method to "spawn" for good (force=True): put it back, or every
    # DataLoader after it (the fastload and MosaicML paths) would spawn its workers
    method = multiprocessing.get_start_method(allow_none=True)
    try:
        optimize(fn=_litdata_item, inputs=items, output_dir=out, chunk_bytes=chunk_bytes, num_workers=1,
                 reorder_files=False, verbose=False)
    finally:
        multiprocessing.set_start_method(method, force=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(staging, ignore_errors=True)
    return len(items)


def _litdata_http() -> dict[str, str]:
    """LitData uploads and downloads part of its objects with obstore, whose client refuses a plain-http
    endpoint (``builder error``) unless allowed, and LitData 0.2.76 passes its own client options
    (``litdata.streaming.downloader._OBSTORE_CLIENT_OPTIONS``, no ``allow_http``), which the environment
    does not override. The user named a plain-http endpoint (as fastload's own client allows it): allow
    it there too, in this process; LitData's workers are spawned, so ``_PeerDecode`` (the dataset's
    transform, unpickled in each worker) calls this again there."""
    import os

    if not os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://"):
        return {}
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": True}
    return {"AWS_ALLOW_HTTP": "true"}


class _PeerDecode:
    """A peer's sample ``{"image": bytes, "label": int}`` -> fastload's eval transform of the image decoded
    with PIL, and the label: the same output as the fastload paths, decoded as those peers' users do.
    Picklable (LitData pickles its dataset's transform into its workers)."""

    def __init__(self, image_size: int) -> None:
        self.image_size = image_size
        self._transform = None

    def __getstate__(self) -> dict:
        return {"image_size": self.image_size, "_transform": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        import sys

        if "litdata" in sys.modules:  # in a LitData worker (spawned: the parent's patch is not here)
            _litdata_http()

    def __call__(self, s: dict):
        import io

        from PIL import Image

        if self._transform is None:
            import fastload

            self._transform = fastload.eval_transform(size=self.image_size)
        with Image.open(io.BytesIO(s["image"])) as im:
            return self._transform(im.convert("RGB")), s["label"]


def _decoding(base: type, o: RemoteBenchOptions) -> type:
    """``base`` (MosaicML's ``StreamingDataset``) whose samples come out through ``_PeerDecode``."""
    decode = _PeerDecode(o.image_size)

    class _Images(base):
        def __getitem__(self, index):
            return decode(super().__getitem__(index))

    return _Images


def _mosaic_dataset(o: RemoteBenchOptions):
    from streaming import StreamingDataset

    return _decoding(StreamingDataset, o)


def _files(folder: Path, pattern: str) -> dict[str, tuple[int, int]]:
    """``{path: (size, mtime_ns)}`` of the peer's cache files under ``folder``."""
    return {str(f): (st.st_size, st.st_mtime_ns) for f in folder.rglob(pattern) for st in (f.stat(),)}


def _written(folder: Path, pattern: str, before: dict[str, tuple[int, int]]) -> int:
    """Bytes of the cache files that are new or rewritten since ``before``: the epoch's downloads, cold or warm."""
    return sum(size for f, (size, mtime) in _files(folder, pattern).items() if before.get(f) != (size, mtime))


def _mosaic_epoch(url: str, o: RemoteBenchOptions, local: Path) -> Epoch:
    import torch
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    before = _files(local, "*.mds") if local.exists() else {}
    t0 = time.perf_counter()
    ds = _mosaic_dataset(o)(remote=url, local=str(local), shuffle=True, shuffle_seed=0, batch_size=o.batch_size)
    # torch's DataLoader, as MosaicML Streaming's docs use it
    loader = torch.utils.data.DataLoader(ds, batch_size=o.batch_size, num_workers=o.workers)
    r = _drain(loader, t0, lambda: _written(local, "*.mds", before))
    del loader, ds
    return r


def _litdata_epoch(url: str, o: RemoteBenchOptions, local: Path) -> Epoch:
    """One LitData epoch in a fresh spawned process (the module docstring says why)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_litdata_epoch_here, url, o, str(local)).result()


def _litdata_epoch_here(url: str, o: RemoteBenchOptions, local: str) -> Epoch:
    import os

    from litdata import StreamingDataLoader, StreamingDataset

    import multiprocessing

    os.environ.update(_litdata_http())  # this (spawned) process is LitData's alone
    # a spawned process inherits "spawn" as its start method: give LitData's loader the platform's default,
    # as it has in a user's script (else its workers start slower than the other paths')
    multiprocessing.set_start_method(None, force=True)
    cache = Path(local)
    cache.mkdir(parents=True, exist_ok=True)
    before = _files(cache, "*.bin")
    t0 = time.perf_counter()
    ds = StreamingDataset(input_dir=url, cache_dir=str(cache), shuffle=True, seed=0,
                          transform=_PeerDecode(o.image_size))  # LitData's own transform hook
    # LitData's own loader, as its docs use it
    loader = StreamingDataLoader(ds, batch_size=o.batch_size, num_workers=o.workers)
    r = _drain(loader, t0, lambda: _written(cache, "*.bin", before))
    del loader, ds
    return r


class RemoteBench:
    """The result: ``table()`` for people, ``to_json()`` for files."""

    def __init__(self, data: dict) -> None:
        self.data = data

    def to_json(self) -> dict:
        return self.data

    def table(self) -> str:
        return table(self.data)


def _link_share(link, r: Epoch) -> dict:
    """What the link carried in epoch ``r`` (since ``link.mark()``) and the share of its rate that was."""
    sent, first, last = link.traffic()
    seconds = r[3] / r[0] if r[0] else 0.0
    return {"bytes": sent, "of_link_epoch": sent / seconds / link.rate if seconds else 0.0,
            "of_link_downloading": sent / (last - first) / link.rate if last > first else 0.0}


def bench_remote(local: str | Path, url: str, options: RemoteBenchOptions | None = None, *,
                 mosaic_url: str | None = None, litdata_url: str | None = None, dali: bool = False,
                 link=None) -> RemoteBench:
    """Time ``local`` (a folder of shards) against ``url`` (the same store in a bucket), and against
    ``mosaic_url`` (the same images as MosaicML MDS) and ``litdata_url`` (as LitData chunks) when given,
    and DALI (CPU) over both with ``dali``; ``link``: the throttled link the remote paths go through, to
    report its use; see the module docstring."""
    o = options or RemoteBenchOptions()
    work = Path(tempfile.mkdtemp(prefix="fastload-bench-remote-"))
    paths = PATHS + (MOSAIC_PATHS if mosaic_url else ()) + (LITDATA_PATHS if litdata_url else ()) \
        + (DALI_PATHS if dali else ())
    runs = {"local": lambda _: _epoch((str(local),), o, None), "remote": lambda c: _epoch((url,), o, c),
            "dali-local": lambda _: _dali_epoch(str(local), o, None), "dali": lambda c: _dali_epoch(url, o, c),
            "mosaic": lambda c: _mosaic_epoch(mosaic_url, o, c), "litdata": lambda c: _litdata_epoch(litdata_url, o, c)}
    try:
        for p in paths:  # fill the warm caches (not timed)
            if p.endswith("-warm"):
                runs[p.rsplit("-", 1)[0]](work / p)
        results = {p: RemotePath(p) for p in paths}
        for k in range(o.rounds):
            order = paths[k % len(paths):] + paths[: k % len(paths)]
            this = {}
            for p in order:
                if link is not None:
                    link.mark()
                if p in ("local", "dali-local"):
                    r = runs[p](None)
                else:  # "<family>-cold": an empty cache, removed after; "<family>-warm": the one filled before
                    family, cache = p.rsplit("-", 1)
                    folder = work / (p if cache == "warm" else f"{p}{k}")
                    r = runs[family](folder)
                    if cache == "cold":
                        shutil.rmtree(folder, ignore_errors=True)
                this[p] = r
                results[p].images_per_s.append(r[0])
                results[p].first_batch_s.append(r[1])
                results[p].downloaded.append(r[2])
                results[p].images.append(r[3])
                results[p].batch.add(r[4])
                if len(r) > 5:
                    results[p].loader_first_batch_s.append(r[5])
                if link is not None and p not in ("local", "dali-local"):
                    results[p].link.append(_link_share(link, r))
            for p in paths:
                base = "dali-local" if p in DALI_PATHS else "local"
                results[p].ratio_to_local.append(this[p][0] / this[base][0])
        extra = {"link_bytes_per_s": link.rate} if link is not None else {}
        return RemoteBench({"options": asdict(o), "url": url, "local": str(local), **extra,
                "paths": {p: {"images_per_s_median": statistics.median(r.images_per_s),
                              "ratio_to_local": r.ratio_to_local,
                              "first_batch_s_median": statistics.median(r.first_batch_s),
                              "bytes_downloaded_per_epoch": r.downloaded, "images_per_s": r.images_per_s,
                              "images_per_epoch": r.images, "batch": sorted(r.batch),
                              **({"loader_time_to_first_batch_s": r.loader_first_batch_s}
                                 if r.loader_first_batch_s else {}),
                              **({"link": r.link} if r.link else {})}
                          for p, r in results.items()}})
    finally:
        shutil.rmtree(work, ignore_errors=True)


def table(result: dict) -> str:
    link = result.get("link_bytes_per_s")
    rows = [f"{'path':14s} {'images/s':>9s} {'vs local (per round)':>28s} {'first batch':>12s} "
            f"{'downloaded/epoch':>17s} {'images/epoch':>12s}"
            + (f"  of the {link / 1e6:g} MB/s link: epoch | downloading (per round)" if link else "")]
    batches: dict[str, set[str]] = {}
    for p, r in result["paths"].items():
        ratios = " ".join(f"{x:.2f}" for x in r["ratio_to_local"])
        images = sorted(set(r.get("images_per_epoch", [])))
        batches.setdefault("dali" if p.startswith("dali-") else "", set()).update(r.get("batch", []))
        shares = " ".join(f"{x['of_link_epoch']:.2f}|{x['of_link_downloading']:.2f}" for x in r.get("link", [])
                          if x["bytes"] > 1 << 20)
        rows.append(f"{p:14s} {r['images_per_s_median']:>9.0f} {ratios:>28s} {r['first_batch_s_median']:>11.2f}s "
                    f"{statistics.median(r['bytes_downloaded_per_epoch']) / 1e6:>14.1f} MB "
                    f"{'/'.join(map(str, images)):>12s}" + (f"  {shares}" if shares else ""))
    for family, seen in batches.items():
        if seen:
            name = "DALI paths (vs dali-local)" if family else "batch"
            rows.append(f"{name} (images, labels): {' | '.join(sorted(seen))}"
                        + ("" if len(seen) == 1 else "  <- NOT the same on every path"))
    return "\n".join(rows)
