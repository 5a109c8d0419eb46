"""The figures of docs/streaming.md: SeaweedFS on loopback (tests/s3.py's S3Server, free ports,
127.0.0.1 only), a generated tree converted into K shards and published with its manifest, then
`fastload bench loader --remote` (fastload.bench.remote) against the same shards on local disk.

Usage: python tools/bench_remote_loopback.py PER_CLASS SHARDS OUT.json ROUNDS [--mosaic] [--litdata] [--dali]
       [--link-mbps N]
(10 classes of PER_CLASS images, 200-400 px JPEGs; the server is stopped at the end). --mosaic: also
the same images as MosaicML Streaming MDS (its writer, ~4 MB shards) on the same server. --litdata:
also the same images as LitData chunks (its optimize(), ~4 MB chunks) on the same server. --dali: also
fastload.DALILoader (CPU) over the local shards and the bucket, cold and warm.
--link-mbps N: every client of the server (this process, its workers, the peers') reaches it through
one link of N MB/s (1 MB = 10^6 bytes) towards the client, shared by all connections: the throttling
proxy of the tests (tests/load/remote_helpers.py::Proxy, shared=True) in its own process, so that the
remote paths are limited by the link while local disk is not. Before the bench it checks that the
proxy carries N MB/s (one 64 MB object, one GET, then 4 at once), and the bench reports, per remote
epoch, the share of the link's rate it used."""
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
_TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(_TESTS), str(_TESTS / "load")]
import s3 as s3mod
from fastload.datasets import DatasetSpec, make_dataset


def _serve_link(target: int, rate: float, conn) -> None:
    """The link's process: a shared-rate proxy, answering "mark" / "traffic" / "stop" on ``conn``."""
    from remote_helpers import Proxy

    proxy = Proxy(target, rate, shared=True)
    conn.send(proxy.port)
    while True:
        cmd = conn.recv()
        if cmd == "mark":
            proxy.mark()
            conn.send(None)
        elif cmd == "traffic":
            conn.send(proxy.traffic())
        else:
            proxy.close()
            conn.send(None)
            return


class Link:
    """A link of ``rate`` bytes/s to the server at ``target`` (a port): ``endpoint`` for the clients."""

    def __init__(self, target: int, rate: float) -> None:
        self.rate = rate
        # forked before this process uses obstore (whose runtime does not survive fork)
        self._conn, child = multiprocessing.Pipe()
        self._proc = multiprocessing.get_context("fork").Process(target=_serve_link, args=(target, rate, child),
                                                                 daemon=True)
        self._proc.start()
        self.endpoint = f"http://127.0.0.1:{self._conn.recv()}"

    def _ask(self, cmd: str):
        self._conn.send(cmd)
        return self._conn.recv()

    def mark(self) -> None:
        self._ask("mark")

    def traffic(self) -> tuple[int, float, float]:
        return self._ask("traffic")

    def close(self) -> None:
        self._ask("stop")
        self._proc.join(10)


def check_link(link: Link, url: str, size: int = 64 << 20) -> None:
    """Print the rate the link carried one ``size``-byte object at, alone and 4 GETs at once."""
    from concurrent.futures import ThreadPoolExecutor

    from fastload.store import remote

    remote.put_bytes(url, os.urandom(size))  # towards the server: not throttled
    for n in (1, 4):
        link.mark()
        t0 = time.monotonic()
        with ThreadPoolExecutor(n) as pool:
            got = sum(len(b) for b in pool.map(lambda _: remote.get_bytes(url), range(n)))
        seconds = time.monotonic() - t0
        print(f"link check: {n} GET(s) of {size / 1e6:.0f} MB: {got / seconds / 1e6:.1f} MB/s "
              f"= {got / seconds / link.rate:.3f} of the {link.rate / 1e6:g} MB/s link", flush=True)


def main():
    argv = list(sys.argv[1:])
    link_mbps = None
    if "--link-mbps" in argv:  # its value removed by position (it may equal a positional argument)
        i = argv.index("--link-mbps")
        link_mbps = float(argv[i + 1])
        del argv[i:i + 2]
    args = [a for a in argv if not a.startswith("--")]
    root = Path(tempfile.mkdtemp(prefix="ss-bench-"))
    ports = dict(zip(s3mod._PORTS, s3mod._free_ports(len(s3mod._PORTS))))
    (root / "data").mkdir()
    srv = s3mod.S3Server(s3mod._weed(), root / "data", ports)
    srv.start()
    link = None
    try:
        srv.wait_ready()
        os.environ.update(srv.env)
        if link_mbps is not None:  # every client from here on (workers and peers inherit the environment)
            link = Link(int(srv.endpoint.rsplit(":", 1)[1]), link_mbps * 1e6)
            os.environ["AWS_ENDPOINT_URL"] = link.endpoint
        from remote_helpers import publish, sharded_store
        tree = make_dataset(root / "tree", DatasetSpec(num_classes=10, per_class=int(args[0]), min_side=200, max_side=400, png_every=0, seed=1), workers=1)
        store = sharded_store(tree, root / "store", int(args[1]))
        srv.make_bucket("bench")
        url = "s3://bench/store/"
        man = publish(store, url)
        print("store", man.num_samples, "samples", len(man.shards), "shards", sum(e.bytes for e in man.shards) / 1e6, "MB", flush=True)
        if link is not None:
            check_link(link, "s3://bench/link-check")
        from fastload.bench.remote import RemoteBenchOptions, bench_remote, write_mds
        mosaic = None
        if "--mosaic" in sys.argv:
            os.environ["S3_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL"]  # streaming's boto3 client
            mosaic = "s3://bench/mds/"
            write_mds(store, mosaic)
        litdata = None
        if "--litdata" in sys.argv:  # LitData's boto3 client reads AWS_ENDPOINT_URL (set above)
            from fastload.bench.remote import write_litdata

            litdata = "s3://bench/litdata/"
            write_litdata(store, litdata)
        r = bench_remote(store, url, RemoteBenchOptions(workers=2, batch_size=64, image_size=128, rounds=int(args[3])),
                         mosaic_url=mosaic, litdata_url=litdata, dali="--dali" in sys.argv, link=link)
        print(r.table())
        Path(args[2]).write_text(json.dumps(r.to_json(), indent=1))
    finally:
        if link is not None:
            link.close()
        srv.stop()
        import shutil

        shutil.rmtree(root, ignore_errors=True)

if __name__ == '__main__':
    main()
