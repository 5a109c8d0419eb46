"""The figures of docs/streaming.md: SeaweedFS on loopback (tests/s3.py's S3Server, free ports,
127.0.0.1 only), a generated tree converted into K shards and published with its manifest, then
`fastload bench loader --remote` (fastload.bench.remote) against the same shards on local disk.

Usage: python tools/bench_remote_loopback.py PER_CLASS SHARDS OUT.json ROUNDS [--mosaic] [--litdata]
(10 classes of PER_CLASS images, 200-400 px JPEGs; the server is stopped at the end). --mosaic: also
the same images as MosaicML Streaming MDS (its writer, ~4 MB shards) on the same server. --litdata:
also the same images as LitData chunks (its optimize(), ~4 MB chunks) on the same server."""
import json
import os
import sys
import tempfile
from pathlib import Path
_TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(_TESTS), str(_TESTS / "load")]
import s3 as s3mod
from fastload.datasets import DatasetSpec, make_dataset

def main():
    root = Path(tempfile.mkdtemp(prefix="ss-bench-"))
    ports = dict(zip(s3mod._PORTS, s3mod._free_ports(len(s3mod._PORTS))))
    (root / "data").mkdir()
    srv = s3mod.S3Server(s3mod._weed(), root / "data", ports)
    srv.start()
    try:
        srv.wait_ready()
        os.environ.update(srv.env)
        from remote_helpers import publish, sharded_store
        tree = make_dataset(root / "tree", DatasetSpec(num_classes=10, per_class=int(sys.argv[1]), min_side=200, max_side=400, png_every=0, seed=1), workers=1)
        store = sharded_store(tree, root / "store", int(sys.argv[2]))
        srv.make_bucket("bench")
        url = "s3://bench/store/"
        man = publish(store, url)
        print("store", man.num_samples, "samples", len(man.shards), "shards", sum(e.bytes for e in man.shards) / 1e6, "MB", flush=True)
        from fastload.bench.remote import RemoteBenchOptions, bench_remote, write_mds
        mosaic = None
        if "--mosaic" in sys.argv:
            os.environ["S3_ENDPOINT_URL"] = srv.endpoint  # streaming's boto3 client
            mosaic = "s3://bench/mds/"
            write_mds(store, mosaic)
        litdata = None
        if "--litdata" in sys.argv:  # LitData's boto3 client reads AWS_ENDPOINT_URL (set above)
            from fastload.bench.remote import write_litdata

            litdata = "s3://bench/litdata/"
            write_litdata(store, litdata)
        r = bench_remote(store, url, RemoteBenchOptions(workers=2, batch_size=64, image_size=128, rounds=int(sys.argv[4])),
                         mosaic_url=mosaic, litdata_url=litdata)
        print(r.table())
        Path(sys.argv[3]).write_text(json.dumps(r.to_json(), indent=1))
    finally:
        srv.stop()
        import shutil

        shutil.rmtree(root, ignore_errors=True)

if __name__ == '__main__':
    main()
