"""The remote benchmark's peers on the loopback server: LitData reading the same images, written by its own
``optimize()``, with the same count and batch contract as the fastload paths."""

from __future__ import annotations

import gc
import multiprocessing

import pytest

from fastload.bench.remote import RemoteBenchOptions, bench_remote, write_litdata
from remote_helpers import publish, sharded_store

pytest.importorskip("litdata", reason="LitData is the bench extra's (pip install 'fastload[bench]')")


@pytest.mark.slow
# LitData's optimize() leaves asyncio event loops unclosed (its uploads); not ours to fix
@pytest.mark.filterwarnings("ignore:unclosed event loop:ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_litdata_path_reads_the_same_images_with_the_same_batches(s3_server, fresh_bucket, tiny_tree, tmp_path):
    local = sharded_store(tiny_tree, tmp_path / "store", 3)
    url = s3_server.url(fresh_bucket, "store/")
    n = publish(local, url).num_samples
    lit = s3_server.url(fresh_bucket, "litdata/")
    method = multiprocessing.get_start_method(allow_none=True)
    assert write_litdata(local, lit, chunk_bytes=1 << 16) == n  # several chunks
    assert multiprocessing.get_start_method(allow_none=True) == method  # optimize() forces "spawn": put back
    gc.collect()  # LitData's leaked event loops are reported here, under this test's filters, not at exit
    out = bench_remote(local, url, RemoteBenchOptions(workers=2, batch_size=4, image_size=32, rounds=1),
                       litdata_url=lit).to_json()["paths"]
    assert set(out) == {"local", "remote-cold", "remote-warm", "litdata-cold", "litdata-warm"}
    for name, path in out.items():
        assert path["images_per_epoch"] == [n], name
    assert {b for p in out.values() for b in p["batch"]} == {"torch.uint8 [3, 32, 32], torch.int64"}
    assert out["litdata-cold"]["bytes_downloaded_per_epoch"][0] > 0
    assert out["litdata-warm"]["bytes_downloaded_per_epoch"] == [0]
