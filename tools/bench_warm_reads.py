"""Per-sample cost of reading a store through a warm node cache against the same shards on local disk,
in one process (no workers, no link): what the warm path adds to every read.

Usage: python tools/bench_warm_reads.py [PER_CLASS] [ROUNDS]
(10 classes of PER_CLASS 200-400 px JPEGs, default 100, in 8 shards, published to SeaweedFS on loopback
(tests/s3.py's S3Server, 127.0.0.1 only, stopped at the end); the cache is filled first. Each round
reads every sample with ``get_bytes`` (the stored bytes, crc32 checked) through each path, then every
third sample with ``dataset[i]`` (decode + ``eval_transform(size=128)``), the paths' order alternating
per round. Prints microseconds per sample, median and per round, and warm/local.)
"""
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

_TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(_TESTS), str(_TESTS / "load")]


def _per_sample(ds, indices) -> float:
    t = time.perf_counter()
    for i in indices:
        ds[i] if ds.transform is not None else ds.get_bytes(i)
    return (time.perf_counter() - t) / len(indices) * 1e6


def main(per_class: int = 100, rounds: int = 7) -> None:
    import s3 as s3mod
    from remote_helpers import publish, sharded_store

    import fastload
    from fastload.datasets import DatasetSpec, make_dataset

    root = Path(tempfile.mkdtemp(prefix="fastload-warm-reads-"))
    tree = make_dataset(root / "tree", DatasetSpec(num_classes=10, per_class=per_class, min_side=200, max_side=400,
                                                   png_every=0), workers=2)
    store = sharded_store(tree, root / "store", 8)
    server = s3mod.start_server(root / "s3")
    try:
        os.environ.update(server.env)
        server.make_bucket("bench")
        url = server.url("bench", "store/")
        publish(store, url)
        tf = fastload.eval_transform(size=128)
        paths = {"local": (fastload.LMDBImageDataset(store), fastload.LMDBImageDataset(store, transform=tf)),
                 "warm": (fastload.LMDBImageDataset(url, cache_dir=root / "cache"),
                          fastload.LMDBImageDataset(url, cache_dir=root / "cache", transform=tf))}
        n = len(paths["local"][0])
        for i in range(n):
            paths["warm"][0].get_bytes(i)  # fills the cache
        for what, k, indices in (("get_bytes", 0, range(n)), ("decoded", 1, range(0, n, 3))):
            res: dict[str, list[float]] = {"local": [], "warm": []}
            for r in range(rounds):
                for name in (("local", "warm") if r % 2 == 0 else ("warm", "local")):
                    res[name].append(_per_sample(paths[name][k], indices))
            ratio = [w / loc for w, loc in zip(res["warm"], res["local"])]
            for name, v in res.items():
                print(f"{what:9s} {name:5s} us/sample median {statistics.median(v):8.1f}  per round "
                      + " ".join(f"{x:.1f}" for x in v))
            print(f"{what:9s} warm/local per round " + " ".join(f"{x:.3f}" for x in ratio)
                  + f"  median {statistics.median(ratio):.3f}")
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(*[int(a) for a in sys.argv[1:3]])
