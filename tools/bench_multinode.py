"""Across real links on one machine: conversion on 1 vs 2 Ray nodes, and streaming per node, cold and warm.

    python tools/bench_multinode.py convert [--mbit 200] [--rounds 2] [--num-shards 16 ...] [--per-class 80] [--json OUT]
    python tools/bench_multinode.py stream [--mbit 100 400] [--rounds 2] [--per-class 80] [--json OUT]
    python tools/bench_multinode.py get [--mbit 200] [--rounds 2]

As root (network namespaces; tests/netns.py builds them): SeaweedFS in a node of its own, nodes a and b
on a bridge, each node's link shaped with tc tbf to ``--mbit`` both ways. The data is the generated
default dataset (``--per-class`` images in each of 10 classes, 200-800 px JPEGs and a few PNGs).

``convert``: the folder uploaded to ``s3://src/``, then ``fastload convert s3://src/... s3://dst/...
--engine ray`` driven from node a, with a Ray head on a (1 CPU) alone or with a worker on b (1 CPU),
the two alternating in rounds; per run: wall seconds and images/s (the driver's own report line), bytes
each node's link received and sent, and the CPU seconds SeaweedFS spent. With several
``--num-shards``, each is run per node count: the difference is the cost of a task beyond its images. Beside it, one core's rate
converting the same folder from local disk (``--workers 1``, no network), and the link's capacity,
so the table says which of CPU, link and server bounds the conversion.

``get``: the round trip of one source image's GET (100 KB objects, sequential), from node a alone
and from both nodes at once: what a conversion task pays per source file before any decoding.

``stream``: the folder converted to 16 shards, published to the bucket; for each rate, both nodes read
the store as ranks 0 and 1 of 2 (tools/multinode_reader.py, 1 worker each), one cold epoch (empty cache)
and one warm epoch (same cache), both nodes at once; per node: seconds to the first batch, epoch
seconds, shards downloaded, bytes its link received.

Every figure is from this machine, whose 2 cores run every node, the bucket and Ray's own processes:
a node here is a network namespace, not a machine of its own. Say so beside any figure quoted.

Must not: be imported by the package (a tool, run by hand).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(_TESTS), str(_TESTS / "load")]

from netns import Cluster  # noqa: E402

from fastload.datasets import DatasetSpec, make_dataset  # noqa: E402

HERE = Path(__file__).resolve().parent


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _upload_tree(node, bucket, tree: Path, prefix: str) -> None:
    node.run([sys.executable, "-c", "import sys, pathlib; from fastload.store import remote\n"
              "root = pathlib.Path(sys.argv[1])\nfor p in sorted(root.rglob('*')):\n"
              "    if p.is_file(): remote.upload_file(p, remote.RemoteLocation.parse(sys.argv[2] + "
              "p.relative_to(root).as_posix()))", tree, prefix], env=bucket.env, timeout=1800)


def _ray_env(node, bucket) -> dict[str, str]:
    if not hasattr(node, "cluster_temp"):  # each node's Ray folder its own (see tests/load/test_multinode.py)
        node.cluster_temp = tempfile.mkdtemp(prefix=f"flray{node.name}")
    return dict(bucket.env, HOME=str(node.root / "home"), RAY_AUTH_MODE="token", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1",
                RAY_TMPDIR=node.cluster_temp)


def _ray_head(a, bucket) -> None:
    (a.root / "home" / ".ray").mkdir(parents=True, exist_ok=True)
    a.run([_bin("ray"), "get-auth-token", "--generate"], env=_ray_env(a, bucket))
    a.run([_bin("ray"), "start", "--head", f"--node-ip-address={a.address}", "--port=6379", "--num-cpus=1",
           "--include-dashboard=false", "--disable-usage-stats"], env=_ray_env(a, bucket))


def _ray_worker(a, b, bucket, up: bool) -> None:
    if up:
        (b.root / "home" / ".ray").mkdir(parents=True, exist_ok=True)
        shutil.copy(a.root / "home" / ".ray" / "auth_token", b.root / "home" / ".ray" / "auth_token")
        b.run([_bin("ray"), "start", f"--address={a.address}:6379", f"--node-ip-address={b.address}",
               "--num-cpus=1", "--disable-usage-stats"], env=_ray_env(b, bucket))
    else:
        b.kill()  # the node leaves; the head notices (tasks are only sent to live nodes)
        time.sleep(35)  # Ray marks a node dead after its health checks fail (~30 s)


def _weed_cpu(bucket) -> float:
    import psutil

    total = 0.0
    for pid in bucket.node.pids():
        try:
            p = psutil.Process(pid)
            if "weed" in p.name():
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _per_core_rate(tree: Path, tmp: Path) -> float:
    out = subprocess.run([_bin("fastload"), "convert", str(tree), str(tmp / "local-one-core"), "--workers", "1", "-q"],
                         capture_output=True, text=True, check=True)
    return float(re.search(r"\(([\d.]+) img/s\)", out.stdout).group(1))


def convert(args, tmp: Path, cluster: Cluster, tree: Path, n_images: int) -> dict:
    bucket = cluster.bucket()
    a, b = cluster.node("a"), cluster.node("b")
    for node in (a, b):
        node.shape(args.mbit)
    for name in ("src", "dst"):
        bucket.make_bucket(name)
    _upload_tree(a, bucket, tree, "s3://src/tree/")
    src_bytes = sum(p.stat().st_size for p in tree.rglob("*") if p.is_file())
    _ray_head(a, bucket)
    rows = []
    for r in range(args.rounds):
        for nodes in ((1, 2) if r % 2 == 0 else (2, 1)):
            if nodes == 2:
                _ray_worker(a, b, bucket, True)
            for shards in (args.num_shards if r % 2 == 0 else list(reversed(args.num_shards))):
                before = {n.name: n.link_bytes() for n in (a, b)}
                cpu0 = _weed_cpu(bucket)
                out = a.run([_bin("fastload"), "convert", "s3://src/tree/", f"s3://dst/r{r}n{nodes}s{shards}/", "--engine",
                             "ray", "--address", f"{a.address}:6379", "--num-shards", str(shards), "-q"],
                            env=_ray_env(a, bucket), timeout=3600).stdout
                link = {n.name: [x - y for x, y in zip(n.link_bytes(), before[n.name])] for n in (a, b)}
                m = re.search(r"in ([\d.]+)s \(([\d.]+) img/s\)", out)
                rows.append({"round": r, "nodes": nodes, "shards": shards, "seconds": float(m.group(1)),
                             "images_per_s": float(m.group(2)), "received": {k: v[0] for k, v in link.items()},
                             "sent": {k: v[1] for k, v in link.items()}, "server_cpu_s": _weed_cpu(bucket) - cpu0})
                print(json.dumps(rows[-1]), flush=True)
            if nodes == 2:
                _ray_worker(a, b, bucket, False)
    core = _per_core_rate(tree, tmp)
    return {"images": n_images, "source_bytes": src_bytes, "mbit": args.mbit, "per_core_images_per_s": core,
            "rows": rows}


def stream(args, tmp: Path, cluster: Cluster, tree: Path, n_images: int) -> dict:
    from remote_helpers import sharded_store

    bucket = cluster.bucket()
    a, b = cluster.node("a"), cluster.node("b")
    local = sharded_store(tree, tmp / "store", 16)
    bucket.make_bucket("train")
    url = "s3://train/store/"
    a.run([sys.executable, "-c", "import sys, pathlib; from remote_helpers import publish; "
           "publish(pathlib.Path(sys.argv[1]), sys.argv[2])", local, url], env=bucket.env, timeout=1800)
    store_bytes = sum(p.stat().st_size for p in local.rglob("data.mdb"))
    rows = []
    for r in range(args.rounds):
        for mbit in (args.mbit if r % 2 == 0 else list(reversed(args.mbit))):
            for node in (a, b):
                node.shape(mbit)
                shutil.rmtree(node.root / "cache", ignore_errors=True)
            before = {n.name: n.link_bytes()[0] for n in (a, b)}
            procs = {n.name: n.popen([sys.executable, HERE / "multinode_reader.py", url, n.root / "cache", k, 2, 2,
                                      n.root / "reader.json"], env=bucket.env, log=n.root / "reader.log")
                     for k, n in enumerate((a, b))}
            for name, p in procs.items():
                if p.wait(timeout=3600) != 0:
                    raise RuntimeError(f"{name}: {p.log.read_text()[-3000:]}")
            for n in (a, b):
                epochs = json.loads((n.root / "reader.json").read_text())
                rows.append({"round": r, "mbit": mbit, "node": n.name, "received": n.link_bytes()[0] - before[n.name],
                             "cold": epochs[0], "warm": epochs[1]})
                print(json.dumps(rows[-1]), flush=True)
    return {"images": n_images, "store_bytes": store_bytes, "shards": 16, "rows": rows}


_GETS = """
import sys, time
from fastload.store import remote
n = int(sys.argv[1])
urls = [f"s3://src/obj{i}" for i in range(n)]
remote.get_bytes(urls[0])
t0 = time.perf_counter()
for u in urls:
    remote.get_bytes(u)
print((time.perf_counter() - t0) / n * 1000)
"""


def gets(args, tmp: Path, cluster: Cluster, tree: Path, n_images: int) -> dict:
    """Sequential GETs of 100 KB objects (a source image's size) from node a alone, then from a and b at once."""
    bucket = cluster.bucket()
    a, b = cluster.node("a"), cluster.node("b")
    for node in (a, b):
        node.shape(args.mbit[0])
    bucket.make_bucket("src")
    a.run([sys.executable, "-c", "from fastload.store import remote\nfor i in range(200): "
           "remote.put_bytes(remote.RemoteLocation.parse(f's3://src/obj{i}'), b'x' * 100_000)"], env=bucket.env)
    rows = []
    for r in range(args.rounds):
        alone = float(a.run([sys.executable, "-c", _GETS, "200"], env=bucket.env).stdout)
        procs = [n.popen([sys.executable, "-c", _GETS, "200"], env=bucket.env, log=n.root / f"gets{r}.log")
                 for n in (a, b)]
        both = [p.wait(timeout=600) or float(p.log.read_text().split()[-1]) for p in procs]
        rows.append({"round": r, "alone_ms": alone, "together_ms": both})
        print(json.dumps(rows[-1]), flush=True)
    return {"mbit": args.mbit[0], "object_bytes": 100_000, "rows": rows}


def _table(kind: str, res: dict) -> None:
    if kind == "get":
        alone = [x["alone_ms"] for x in res["rows"]]
        both = [y for x in res["rows"] for y in x["together_ms"]]
        print(f"\nGET of a 100 KB object at {res['mbit']} Mbit/s: {statistics.median(alone):.1f} ms from one node "
              f"(rounds {min(alone):.1f}-{max(alone):.1f}), {statistics.median(both):.1f} ms with both nodes at once")
        return
    if kind == "convert":
        print(f"\nconvert {res['images']} images ({res['source_bytes'] / 1e6:.1f} MB of sources) at {res['mbit']} Mbit/s "
              f"per node; one core from local disk: {res['per_core_images_per_s']:.0f} img/s")
        for nodes, shards in sorted({(x["nodes"], x["shards"]) for x in res["rows"]}):
            rows = [x for x in res["rows"] if x["nodes"] == nodes and x["shards"] == shards]
            rates = [x["images_per_s"] for x in rows]
            sent = {k: statistics.median(x["sent"][k] for x in rows) / 1e6 for k in ("a", "b")}
            recv = {k: statistics.median(x["received"][k] for x in rows) / 1e6 for k in ("a", "b")}
            print(f"  {nodes} node(s), {shards} shards: {statistics.median(rates):.0f} img/s (rounds {min(rates):.0f}-{max(rates):.0f}); "
                  f"MB sent a/b {sent['a']:.1f}/{sent['b']:.1f}, received a/b {recv['a']:.1f}/{recv['b']:.1f}; "
                  f"server CPU {statistics.median(x['server_cpu_s'] for x in rows):.1f} s")
    else:
        print(f"\nstream {res['images']} images, {res['shards']} shards, {res['store_bytes'] / 1e6:.1f} MB")
        for mbit in sorted({x["mbit"] for x in res["rows"]}):
            for node in ("a", "b"):
                rows = [x for x in res["rows"] if x["mbit"] == mbit and x["node"] == node]
                med = lambda key, part: statistics.median(x[part][key] for x in rows)  # noqa: E731
                print(f"  {mbit} Mbit/s node {node}: first batch cold {med('first_batch_s', 'cold'):.2f} s, warm "
                      f"{med('first_batch_s', 'warm'):.2f} s; epoch cold {med('epoch_s', 'cold'):.2f} s, warm "
                      f"{med('epoch_s', 'warm'):.2f} s; shards downloaded cold {med('downloads', 'cold'):.0f}, warm "
                      f"{med('downloads', 'warm'):.0f}; MB received {statistics.median(x['received'] for x in rows) / 1e6:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kind", choices=["convert", "stream", "get"])
    ap.add_argument("--mbit", type=float, nargs="+", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-shards", type=int, nargs="+", default=[16], help="convert: shard counts compared")
    ap.add_argument("--per-class", type=int, default=80)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.mbit is None:
        args.mbit = [100.0, 400.0] if args.kind == "stream" else [200.0]
    if args.kind == "convert":
        args.mbit = args.mbit[0]
    tmp = Path(tempfile.mkdtemp(prefix="fl-multinode-"))
    cluster = Cluster(tmp / "cluster")
    try:
        if args.kind == "get":
            res = gets(args, tmp, cluster, tmp, 0)
        else:
            tree = make_dataset(tmp / "tree", DatasetSpec(per_class=args.per_class), workers=2)
            n = sum(1 for p in tree.rglob("*") if p.suffix.lower() in {".jpg", ".jpeg", ".png"})
            res = (convert if args.kind == "convert" else stream)(args, tmp, cluster, tree, n)
        _table(args.kind, res)
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))
    finally:
        cluster.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
