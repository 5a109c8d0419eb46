"""``fastload profile`` on a training script that reads a remote store through a throttled link: the time
the loop waited for shard downloads is its own category, and the verdict names storage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from remote_helpers import Proxy, publish, sharded_store

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import os, sys, time
import fastload

# no cache kept between epochs (a fresh cache directory each time): every epoch downloads the 3 shards
for epoch in range(50):
    ds = fastload.LMDBImageDataset(os.environ["STORE_URL"], transform=fastload.eval_transform(size=32),
                                   cache_dir=os.path.join(os.environ["CACHE_ROOT"], str(epoch)))
    loader = fastload.DataLoader(ds, batch_size=4, num_workers=int(os.environ["WORKERS"]))
    for images, labels in loader:
        time.sleep(0.005)
"""


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_profile_says_storage_bound_on_a_slow_link(s3_server, fresh_bucket, tiny_tree, tmp_path, workers):
    store = sharded_store(tiny_tree, tmp_path / "store", 3)
    url = s3_server.url(fresh_bucket, "stores/tiny/")
    publish(store, url)
    shard_bytes = sum((p / "data.mdb").stat().st_size for p in store.iterdir() if p.is_dir()) / 3
    # ~0.25 s per shard through the proxy: 6 batches of 5 ms steps wait ~0.75 s an epoch for downloads
    proxy = Proxy(int(s3_server.endpoint.rsplit(":", 1)[1]), rate=shard_bytes / 0.25)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "out"
    env = dict(os.environ, STORE_URL=url, CACHE_ROOT=str(tmp_path / "cache"), WORKERS=str(workers),
               AWS_ENDPOINT_URL=proxy.endpoint, PYTHONPATH=str(REPO))
    env.pop("FASTLOAD_PROFILE_OUT", None)
    try:
        proc = subprocess.run([sys.executable, "-m", "fastload.cli", "profile", "--steps", "12", "--warmup", "2",
                               "--out", str(out), "--", sys.executable, str(script)], env=env, capture_output=True,
                              text=True, timeout=300)
    finally:
        proxy.close()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "profile.json").read_text())
    samples = summary["samples"]
    assert samples["parts"]["download"] > 0.5, samples["parts"]  # the sample time is mostly the wait
    cache = samples["shard_cache"]
    assert cache["downloads"] >= 3 and cache["wait_s"] > 0.5, cache  # summed over the processes that read
    assert summary["download_wait_fraction"] > 0.4, summary["download_wait_fraction"]
    assert summary["verdict"].startswith("storage-bound: the loop waited for shard downloads"), summary["verdict"]
    assert "storage" in {r["stage"] for r in summary["recommendations"]}
    assert "cache_limit" in proc.stdout and "shard downloads: the loop waited for them" in proc.stdout
    assert "download" in proc.stdout.split("sample ", 1)[1].splitlines()[0]  # a category of the breakdown
