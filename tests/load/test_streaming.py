"""A store in (loopback SeaweedFS) object storage, read through the node cache."""

from __future__ import annotations

import logging
import shutil
import threading
import time

import pytest
import torch

import fastload
from fastload.errors import RemoteStoreError, ShardIntegrityError
from fastload.store import cache as cache_mod
from fastload.store import remote
from remote_helpers import Proxy, publish, sharded_store


@pytest.fixture(scope="module")
def local_shards(tiny_tree, tmp_path_factory):
    return sharded_store(tiny_tree, tmp_path_factory.mktemp("shards") / "store", 3)


@pytest.fixture
def store_url(s3_server, fresh_bucket, local_shards):
    url = s3_server.url(fresh_bucket, "stores/tiny/")
    publish(local_shards, url)
    return url


def downloads() -> int:
    return cache_mod.stats()["downloads"]


def test_same_bytes_labels_and_one_download_per_shard(store_url, local_shards, tmp_path):
    local = fastload.LMDBImageDataset(local_shards)
    before = downloads()
    ds = fastload.LMDBImageDataset(store_url, cache_dir=tmp_path / "cache", cache_limit="1GB")
    assert ds.reader.shard_ordered and len(ds) == len(local) and ds.classes == local.classes
    assert ds.shard_sizes == local.shard_sizes
    for i in range(len(ds)):
        assert ds.get_bytes(i) == local.get_bytes(i)
        assert ds[i][1] == local[i][1]
    assert downloads() - before == 3
    again = fastload.LMDBImageDataset(store_url, cache_dir=tmp_path / "cache")  # warm: nothing downloaded
    assert [again.get_bytes(i) for i in range(len(again))] == [local.get_bytes(i) for i in range(len(local))]
    assert downloads() - before == 3
    assert ds.targets == local.targets


@pytest.mark.parametrize("backend,workers", [("processes", 0), ("processes", 2), ("threads", 2)])
def test_dataloader_reads_every_sample_once(store_url, local_shards, tmp_path, backend, workers):
    ds = fastload.LMDBImageDataset(store_url, transform=fastload.eval_transform(size=32),
                                   cache_dir=tmp_path / "cache")
    loader = fastload.DataLoader(ds, batch_size=4, shuffle=True, num_workers=workers, backend=backend,
                                 generator=torch.Generator().manual_seed(3))
    assert isinstance(loader.sampler, fastload.ShardSampler)
    labels = [y for _x, ys in loader for y in ys.tolist()]
    assert sorted(labels) == sorted(fastload.LMDBImageDataset(local_shards).targets)


def test_targets_and_samples_cost_one_get_and_no_shard(store_url, local_shards, tmp_path):
    local = fastload.LMDBImageDataset(local_shards)
    before = downloads()
    ds = fastload.LMDBImageDataset(store_url, cache_dir=tmp_path / "cache")
    assert ds.targets == local.targets and list(ds.samples) == list(local.samples)
    assert ds.samples[5] == local.samples[5] and len(ds.samples) == len(local)
    assert downloads() == before  # samples.json.gz, not the shards
    assert ds[len(ds) - 1][1] == local.targets[-1]  # a shard read afterwards agrees with it


def test_a_store_without_the_samples_object_reads_labels_from_the_shards(s3_server, fresh_bucket, local_shards,
                                                                         tmp_path):
    url = s3_server.url(fresh_bucket, "stores/v1/")
    assert publish(local_shards, url, format_version=1).samples is None  # as written before format 2
    local = fastload.LMDBImageDataset(local_shards)
    before = downloads()
    ds = fastload.LMDBImageDataset(url, cache_dir=tmp_path / "cache")
    assert ds.targets == local.targets and list(ds.samples) == list(local.samples)
    assert downloads() - before == 3  # today's behaviour: every shard


def test_a_tampered_samples_object_or_field_is_named(store_url, local_shards, tmp_path):
    import json

    from fastload.errors import ManifestError
    from fastload.store.manifest import SAMPLES_NAME, samples_object

    loc = remote.RemoteLocation.parse(store_url)
    labels = fastload.LMDBImageDataset(local_shards).targets
    paths = [p for p, _y in fastload.LMDBImageDataset(local_shards).samples]
    remote.put_bytes(loc.child(SAMPLES_NAME), samples_object([(y + 1) % 3 for y in labels], paths)[0])
    ds = fastload.LMDBImageDataset(store_url, cache_dir=tmp_path / "cache")
    with pytest.raises(ManifestError, match=rf"{SAMPLES_NAME}: .* the manifest says .*\n.*HINT"):
        ds.targets
    with pytest.raises(ManifestError, match=SAMPLES_NAME):
        ds.samples
    man = json.loads(remote.get_bytes(loc.child("manifest.json")))
    man["samples"]["sha256"] = "not hex"
    remote.put_bytes(loc.child("manifest.json"), json.dumps(man).encode())
    with pytest.raises(ManifestError, match=r"manifest.json: the manifest is invalid: samples.sha256"):
        fastload.LMDBImageDataset(store_url, cache_dir=tmp_path / "cache")


def test_replaced_shard_never_gives_wrong_pixels(store_url, local_shards, tmp_path):
    ds = fastload.LMDBImageDataset(store_url, cache_dir=tmp_path / "cache")
    ds.get_bytes(0)  # shard 0 cached; now shard 2 is replaced in the bucket by shard 1's bytes
    loc = remote.RemoteLocation.parse(store_url)
    name1, name2 = (e.name for e in ds._reader.manifest.shards[1:])
    remote.put_bytes(loc.child(f"{name2}/data.mdb"), remote.get_bytes(loc.child(f"{name1}/data.mdb")))
    with pytest.raises(ShardIntegrityError, match=rf"{name2}/data.mdb: the downloaded shard has .*\n.*HINT"):
        ds.get_bytes(len(ds) - 1)
    assert not (tmp_path / "cache" / ds._reader.cache.key / name2).exists()
    remote.delete(loc.child(f"{name1}/data.mdb"))  # deleted: the error names the object
    with pytest.raises(RemoteStoreError, match=rf"{name1}/data.mdb.*no such object"):
        ds.get_bytes(ds.shard_sizes[0])
    assert ds.get_bytes(0)  # the cached shard still reads


@pytest.fixture
def short_retries(monkeypatch):
    monkeypatch.setenv(remote.RETRY_ENV, "3")


def test_endpoint_gone_then_back(store_url, s3_server, tmp_path, monkeypatch, short_retries):
    proxy = Proxy(int(s3_server.endpoint.rsplit(":", 1)[1]))
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        ds = fastload.LMDBImageDataset(store_url, cache_dir=tmp_path / "cache")
        proxy.down()
        t0 = time.monotonic()
        with pytest.raises(RemoteStoreError, match=r"shard-00000-of-00003/data.mdb.*\n.*HINT"):
            ds.get_bytes(0)
        assert time.monotonic() - t0 < 10  # bounded retries, not a hang
        assert not any((tmp_path / "cache" / ds._reader.cache.key / ".partial").iterdir())
        proxy.up()
        assert ds.get_bytes(0)  # the same reader works once the endpoint is back
    finally:
        proxy.close()


def test_a_download_connected_while_the_endpoint_hangs_gets_through_once_it_serves(
        store_url, local_shards, s3_server, tmp_path, monkeypatch):
    """The outage of issue #25 as seen by the client: the endpoint has its port back but does not answer yet
    (a restarting server), a download connects then, and the endpoint serves again. With the default budget
    the download gets through; before, the request waited for the whole request timeout (300 s)."""
    monkeypatch.delenv(remote.RETRY_ENV, raising=False)
    proxy = Proxy(int(s3_server.endpoint.rsplit(":", 1)[1]))
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.setattr(remote, "_STORES", {})
        ds = fastload.LMDBImageDataset(store_url, cache_dir=tmp_path / "cache")  # the manifest read while it serves
        proxy.hang()
        out: dict = {}

        def read() -> None:
            try:
                out["bytes"] = ds.get_bytes(0)
            except BaseException as exc:  # noqa: BLE001 (said below)
                out["error"] = exc

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not proxy.held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proxy.held, "no request connected while the endpoint hung"
        time.sleep(1)
        proxy.up()
        t_up = time.monotonic()
        thread.join(remote.stall_limit() + 15)
        assert not thread.is_alive(), "the download still waits on a request the endpoint never answered"
        assert "error" not in out, repr(out.get("error"))
        assert out["bytes"] == fastload.LMDBImageDataset(local_shards).get_bytes(0)
        assert time.monotonic() - t_up < remote.stall_limit() + 5
    finally:
        proxy.close()


def test_prefetch_downloads_ahead_on_a_slow_link(store_url, s3_server, tmp_path, monkeypatch):
    proxy = Proxy(int(s3_server.endpoint.rsplit(":", 1)[1]), rate=2_000_000)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.setattr(remote, "_STORES", {})
        ds = fastload.LMDBImageDataset(store_url, cache_dir=tmp_path / "cache")
        ds.prefetch_shards([1, 2])
        deadline = time.monotonic() + 60
        specs = ds._reader.specs
        while not all(ds._reader.cache.cached(s) for s in specs[1:]):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not ds._reader.cache.cached(specs[0])
        before = cache_mod.stats()["wait_s"]
        ds.get_bytes(len(ds) - 1)  # prefetched: no wait
        assert cache_mod.stats()["wait_s"] == before
        ds.get_bytes(0)  # not prefetched: the reader waited, and the counter says so
        assert cache_mod.stats()["wait_s"] > before
    finally:
        proxy.close()


def test_bench_loader_remote_needs_the_local_store():
    from click.testing import CliRunner

    from fastload.cli import main

    out = CliRunner().invoke(main, ["bench", "loader", "--remote", "s3://b/store/"])
    assert out.exit_code == 2 and "--remote URL needs --store" in out.output
    out = CliRunner().invoke(main, ["bench", "loader", "--mosaic", "s3://b/mds/"])
    assert out.exit_code == 2 and "--mosaic URL is compared with --remote URL" in out.output
    out = CliRunner().invoke(main, ["bench", "loader", "--litdata", "s3://b/litdata/"])
    assert out.exit_code == 2 and "--litdata URL is compared with --remote URL" in out.output
    out = CliRunner().invoke(main, ["bench", "loader", "--dali"])
    assert out.exit_code == 2 and "--dali is compared with --remote URL" in out.output


def test_inspect_a_url_through_the_cache(store_url, local_shards, tmp_path, monkeypatch):
    import json

    from click.testing import CliRunner

    from fastload.cli import main
    from fastload.store.check import inspect_store

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the default cache dir, here
    out = CliRunner().invoke(main, ["inspect", store_url, "--json"])
    assert out.exit_code == 0, out.output
    info, local = json.loads(out.output), inspect_store(local_shards)
    for key in ("complete", "count", "shards", "classes", "bytes", "encodings", "stored_as"):
        assert info[key] == local[key], key
    assert info["path"] == store_url
    assert (tmp_path / "xdg" / "fastload" / "shards").is_dir()
    gone = inspect_store(store_url.rstrip("/") + "-missing/", cache_dir=tmp_path / "c")
    assert not gone["complete"] and "manifest.json" in gone["problem"]


@pytest.mark.parametrize("backend,workers", [("processes", 0), ("threads", 2)])
def test_time_to_first_batch_is_reported(store_url, local_shards, s3_server, tmp_path, monkeypatch, caplog,
                                         backend, workers):
    shard = min((p / "data.mdb").stat().st_size for p in local_shards.iterdir() if p.is_dir())
    proxy = Proxy(int(s3_server.endpoint.rsplit(":", 1)[1]), rate=shard / 0.5)  # >= 0.5 s for any shard
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.setattr(remote, "_STORES", {})
        ds = fastload.LMDBImageDataset(store_url, transform=fastload.eval_transform(size=32),
                                       cache_dir=tmp_path / "cache")
        loader = fastload.DataLoader(ds, batch_size=4, num_workers=workers, backend=backend)
        assert ds.time_to_first_batch is None and loader.time_to_first_batch is None
        with caplog.at_level("INFO", logger="fastload"):
            it = iter(loader)
            next(it)
        first = loader.time_to_first_batch
        assert 0.3 < first < 60 and ds.time_to_first_batch == first
        assert any("first batch of epoch 0" in r.getMessage() and store_url in r.getMessage()
                   and f"{first:.2f} s" in r.getMessage() for r in caplog.records)
        for _ in it:  # the rest of the epoch does not change it
            pass
        assert loader.time_to_first_batch == first
        list(loader)  # a second epoch, warm cache: much faster
        assert loader.time_to_first_batch < first
    finally:
        proxy.close()


@pytest.mark.dali
def test_dali_time_to_first_batch_is_reported(store_url, local_shards, s3_server, tmp_path, monkeypatch, caplog):
    from fastload.dali import DALILoader, DALIOptions

    shard = min((p / "data.mdb").stat().st_size for p in local_shards.iterdir() if p.is_dir())
    proxy = Proxy(int(s3_server.endpoint.rsplit(":", 1)[1]), rate=shard / 0.5)  # >= 0.5 s for any shard
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)  # DALI's spawned workers read it too
        monkeypatch.setattr(remote, "_STORES", {})
        ld = DALILoader(store_url, 4, train=False, device="cpu", num_threads=1, size=32,
                        options=DALIOptions(cache_dir=str(tmp_path / "cache")))
        try:
            assert ld.time_to_first_batch is None
            with caplog.at_level("INFO", logger="fastload"):
                it = iter(ld)
                next(it)
            first = ld.time_to_first_batch
            assert 0.3 < first < 120
            assert any("first batch of epoch 0" in r.getMessage() and store_url in r.getMessage()
                       and f"{first:.2f} s" in r.getMessage() for r in caplog.records)
            for _ in it:  # the rest of the epoch does not change it
                pass
            assert ld.time_to_first_batch == first
            list(ld)  # a second epoch: warm cache, the pipeline already built
            assert ld.time_to_first_batch < first
        finally:
            ld.close()
    finally:
        proxy.close()


@pytest.mark.dali
@pytest.mark.parametrize("train", [False, True])
def test_dali_loader_from_the_node_cache_gives_the_local_batches(store_url, local_shards, tmp_path, train):
    from fastload.dali import DALILoader, DALIOptions

    def batches(source, **options):
        ld = DALILoader(source, 5, train=train, device="cpu", num_threads=1, size=32, seed=1, return_index=True,
                        options=DALIOptions(**options))
        try:
            return [[(x.numpy(), y.tolist(), i.tolist()) for x, y, i in ld] for _epoch in range(2)]
        finally:
            ld.close()

    before = downloads()
    local = batches(local_shards, order="shards")  # a store in object storage is read by shards
    remote_batches = batches(store_url, cache_dir=str(tmp_path / "cache"), cache_limit="1GB")
    assert len(remote_batches[0]) == len(local[0]) == 5  # 24 samples in batches of 5
    for epoch_r, epoch_l in zip(remote_batches, local):
        for (xr, yr, ir), (xl, yl, il) in zip(epoch_r, epoch_l, strict=True):
            assert ir == il and yr == yl
            assert (xr == xl).all()
    # DALI's spawned workers download into the node cache: each shard once, whatever the epochs
    assert sorted(p.name for p in (tmp_path / "cache").glob("*/*") if p.is_dir() and not p.name.startswith(".")) \
        == sorted(p.name for p in local_shards.iterdir() if p.is_dir())
    assert downloads() == before  # not this process: the workers read, and the loader's labels come from them


@pytest.mark.dali
@pytest.mark.slow
def test_dali_two_ranks_by_shards_with_a_cache_smaller_than_the_store(tiny_tree, s3_server, fresh_bucket,
                                                                       tmp_path_factory):
    """Two ranks on one node read a 12-shard store at once: disjoint, covering, equal batches, in the
    ShardSampler's order; the cold epoch's first 12 downloads are the 12 shards, once each, through a cache
    that holds 9 of the 12 shards (never over it after any step)."""
    from fastload.dali import DALILoader, DALIOptions
    from fastload.load.shards import ShardSampler
    from fastload.store.cache import node_downloads

    store = sharded_store(tiny_tree, tmp_path_factory.mktemp("twelve") / "store", 12)  # 2 samples each
    url = s3_server.url(fresh_bucket, "stores/twelve/")
    man = publish(store, url)
    sizes = sorted((e.bytes for e in man.shards), reverse=True)
    # each rank: 2 shards open in its worker (window + 1), up to 2 prefetched (the next window, for each of
    # the 2 batches DALI may run ahead); 2 ranks, and room for the download in progress
    limit = sum(sizes[:9])
    assert limit < sum(sizes)
    cache_dir = tmp_path_factory.mktemp("node-cache")
    loaders = [DALILoader(url, 2, train=False, shuffle=True, device="cpu", num_threads=1, size=32, seed=5,
                          return_index=True,
                          options=DALIOptions(shard_id=r, num_shards=2, window=1, cache_dir=str(cache_dir),
                                              cache_limit=limit, prefetch_queue_depth=1)) for r in range(2)]
    shard_of = {name: i for i, name in enumerate(e.name for e in man.shards)}
    try:
        assert [len(ld) for ld in loaders] == [6, 6]
        for e in range(2):
            seen = [[], []]
            start = len(node_downloads(cache_dir))
            for (_x0, _y0, i0), (_x1, _y1, i1) in zip(*loaders, strict=True):  # in lock-step, like DDP ranks
                seen[0] += i0.tolist()
                seen[1] += i1.tolist()
                assert loaders[0]._reader.cache.usage() <= limit  # after every step, not only at the end
            assert len(seen[0]) == len(seen[1]) == 12 and sorted(seen[0] + seen[1]) == list(range(24))
            for r in range(2):
                s = ShardSampler([x.count for x in man.shards], num_replicas=2, rank=r, seed=5, window=1)
                s.set_epoch(e)
                assert seen[r] == list(s)  # its own run of whole shards
            if e == 0:  # cold: every shard exactly once (by the rank's worker or the loader's prefetch).
                # Read now: DALI starts the next epoch's first batches as soon as this one ends.
                got = [shard_of[d["shard"]] for d in node_downloads(cache_dir)[start:]]
                assert sorted(got[:12]) == list(range(12))
            assert loaders[0]._reader.cache.usage() <= limit
    finally:
        for ld in loaders:
            ld.close()


@pytest.mark.slow
@pytest.mark.dali
def test_bench_dali_paths_and_the_links_share(store_url, local_shards, s3_server, monkeypatch):
    """The remote bench's DALI paths (the same images, one batch contract among them, cold downloads and warm
    does not, the loader's own first batch) and, through a shared-rate link, each remote epoch's use of it."""
    from fastload.bench.remote import RemoteBenchOptions, bench_remote

    store_bytes = sum((p / "data.mdb").stat().st_size for p in local_shards.iterdir() if p.is_dir())
    link = Proxy(int(s3_server.endpoint.rsplit(":", 1)[1]), rate=store_bytes / 0.5, shared=True)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", link.endpoint)
        monkeypatch.setattr(remote, "_STORES", {})
        result = bench_remote(local_shards, store_url, RemoteBenchOptions(workers=1, batch_size=4, image_size=32,
                                                                          rounds=1), dali=True, link=link)
    finally:
        link.close()
    out = result.to_json()["paths"]
    n = len(fastload.LMDBImageDataset(local_shards))
    assert set(out) == {"local", "remote-cold", "remote-warm", "dali-local", "dali-cold", "dali-warm"}
    for name, path in out.items():
        assert path["images_per_epoch"] == [n], name
    assert {b for p, v in out.items() if p.startswith("dali-") for b in v["batch"]} \
        == {"torch.float32 [3, 32, 32], torch.int64"}
    assert out["dali-local"]["ratio_to_local"] == [1.0]
    assert out["dali-cold"]["bytes_downloaded_per_epoch"][0] == store_bytes
    assert out["dali-warm"]["bytes_downloaded_per_epoch"] == [0]
    for name in ("dali-local", "dali-cold", "dali-warm"):
        assert 0 < out[name]["loader_time_to_first_batch_s"][0] <= out[name]["first_batch_s_median"]
    for name in ("remote-cold", "dali-cold"):  # the shards crossed the link, at some share of its rate
        share = out[name]["link"][0]
        assert share["bytes"] >= store_bytes and 0 < share["of_link_epoch"] <= share["of_link_downloading"]
    assert "local" not in {p for p, v in out.items() if "link" in v}
    assert out["remote-warm"]["link"][0]["bytes"] < store_bytes  # the manifest, no shard
    assert "DALI paths (vs dali-local)" in result.table() and "of the" in result.table()


def test_prefetches_queued_behind_an_endpoint_failure_are_dropped(store_url, s3_server, tmp_path, monkeypatch):
    """A prefetch that retried for the whole budget on a dead endpoint drops the ones queued behind it (each
    would spend another budget on it after the reader has failed); a later prefetch tries again."""
    monkeypatch.setenv(remote.RETRY_ENV, "2")
    proxy = Proxy(int(s3_server.endpoint.rsplit(":", 1)[1]))
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.setattr(remote, "_STORES", {})
        ds = fastload.LMDBImageDataset(store_url, cache_dir=tmp_path / "cache")
        reader = ds._reader
        tried: list[str] = []
        fetch = reader.cache.fetch

        def counting(url, path):
            tried.append(url)
            return fetch(url, path)

        reader.cache.fetch = counting
        proxy.down()
        ds.prefetch_shards([0, 1, 2])  # two threads: shards 0 and 1 at once, 2 queued behind them
        pool = reader._pool
        pool.shutdown(wait=True)  # every queued prefetch has run or been dropped
        reader._pool = None
        assert sorted(tried) == sorted(s.url for s in reader.specs[:2]), tried
        proxy.up()
        ds.prefetch_shards([2])  # queued after the failure: tried again
        reader._pool.shutdown(wait=True)
        assert tried[-1] == reader.specs[2].url and reader.cache.cached(reader.specs[2])
    finally:
        proxy.close()


def test_a_download_whose_process_is_killed_leaves_nothing(store_url, s3_server, tmp_path, monkeypatch):
    """A forked worker downloads in a child process (_fetch_child); torch kills a worker that does not stop
    within 5 s. The child must not go on downloading into a folder nobody reads: it sees its parent go,
    removes its partial file and the folder made for it, and exits."""
    import os
    import subprocess
    import sys

    proxy = Proxy(int(s3_server.endpoint.rsplit(":", 1)[1]), rate=20_000)  # a shard takes seconds
    proxy.mark()
    try:
        env = {**os.environ, **s3_server.env, "AWS_ENDPOINT_URL": proxy.endpoint}
        part = tmp_path / "partial" / "shard-00000.123"
        part.mkdir(parents=True)
        url = store_url + "shard-00000-of-00003/data.mdb"
        middle = subprocess.Popen(
            [sys.executable, "-c", "import subprocess, sys\n"
             "p = subprocess.Popen([sys.executable, '-m', 'fastload.store._fetch_child', sys.argv[1], sys.argv[2]])\n"
             "print(p.pid, flush=True)\np.wait()", url, str(part / "data.mdb")],
            stdout=subprocess.PIPE, text=True, env=env)
        child = int(middle.stdout.readline())
        deadline = time.monotonic() + 30
        while not (list(part.glob(".data.mdb.*.part")) and proxy.traffic()[0]):  # the body is streaming
            assert time.monotonic() < deadline, "the download never started"
            time.sleep(0.05)
        middle.kill()  # SIGKILL: no cleanup of its own
        middle.wait()
        middle.stdout.close()

        def running(pid: int) -> bool:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return " Z " not in f.read()  # a zombie has stopped
            except FileNotFoundError:
                return False

        deadline = time.monotonic() + 10
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(child), "the download went on after the process that wanted it died"
        assert not part.exists(), list(part.iterdir())
    finally:
        proxy.close()


def test_a_download_whose_process_died_before_it_started_does_nothing(tmp_path):
    """The worker may be killed before the download's interpreter has started: the child is then already
    someone else's, so it is told its parent's pid and checks it before downloading anything."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    part = tmp_path / "partial" / "shard-00000.123"
    part.mkdir(parents=True)
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "fastload.store._fetch_child", "s3://nowhere/x/data.mdb",
                           str(part / "data.mdb"), str(gone.pid)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 4, done.stderr
    assert not part.exists() and time.monotonic() - t0 < 30


def test_two_readers_of_one_store_in_one_process(store_url, local_shards, tmp_path):
    """Readers in one process share one LMDB handle per shard file: one giving a shard back (which closes
    the handle) must not break the other's next read of it (each read finds the live handle)."""
    local = fastload.LMDBImageDataset(local_shards)
    a = fastload.LMDBImageDataset(store_url, cache_dir=tmp_path / "cache")
    b = fastload.LMDBImageDataset(store_url, cache_dir=tmp_path / "cache")
    assert a.get_bytes(0) == b.get_bytes(0) == local.get_bytes(0)
    a._reader.close()  # gives shard 0 back: this process's handle on its file is closed
    assert b.get_bytes(1) == local.get_bytes(1)
    assert [b[i][1] for i in range(len(b))] == [local[i][1] for i in range(len(local))]


def test_a_limit_of_two_shards_with_one_sequential_reader_never_waits_on_itself(store_url, local_shards, tmp_path):
    """The reader keeps up to 5 shards open; under a limit that holds ~2 it waited 120 s on its own leases,
    then failed. It now gives its oldest back when the cache needs the room."""
    local = fastload.LMDBImageDataset(local_shards)
    biggest = max((p / "data.mdb").stat().st_size for p in local_shards.iterdir() if p.is_dir())
    ds = fastload.LMDBImageDataset(store_url, cache_dir=tmp_path / "cache", cache_limit=2 * biggest + biggest // 2)
    ds._reader.cache.wait_s = 2.0  # before the fix: the wait on itself, shortened
    for _round in range(2):
        assert [ds.get_bytes(i) for i in range(len(ds))] == [local.get_bytes(i) for i in range(len(local))]
        assert [ds[i][1] for i in range(len(ds))] == local.targets
        assert ds._reader.cache.usage() <= 2 * biggest + biggest // 2


def test_a_shard_given_back_under_the_limit_and_needed_again_is_said_once(store_url, local_shards, tmp_path, caplog):
    """Under a limit that holds ~2 shards, a reader that reads the store twice gets each shard back by
    downloading it again: before, nothing said so (a shuffled window under such a limit downloads a whole
    shard for nearly every sample). One warning, naming the limit and the size that would do."""
    biggest = max((p / "data.mdb").stat().st_size for p in local_shards.iterdir() if p.is_dir())
    ds = fastload.LMDBImageDataset(store_url, cache_dir=tmp_path / "cache", cache_limit=2 * biggest + biggest // 2)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        for _round in range(2):
            for i in range(len(ds)):
                ds.get_bytes(i)
    said = [r.getMessage() for r in caplog.records if "given back to make room" in r.getMessage()]
    assert len(said) == 1, said
    assert f"cache_limit={2 * biggest + biggest // 2}" in said[0] and f"{5 * biggest} bytes" in said[0]


def test_a_shard_a_thread_is_reading_is_never_given_back(store_url, tmp_path):
    """With backend='threads', one thread's read of a shard could have its handle closed and the shard
    evicted by another thread that needed room (the read then called an intact store damaged)."""
    ds = fastload.LMDBImageDataset(store_url, cache_dir=tmp_path / "cache")
    reader = ds._reader
    for j in (0, 1):
        reader._shard(j)
    reader._shard(0, hold=True)  # a read of shard 0 in flight, though 0 is the least recently used
    with reader._lock:
        assert reader._give_back_one()  # shard 1 goes, not shard 0
        assert list(reader._open) == [0]
        assert not reader._give_back_one()  # only the shard being read is left: nothing to give
    reader._let_go(0)
    with reader._lock:
        assert reader._give_back_one() and not reader._open


def test_a_store_re_uploaded_while_an_old_job_holds_its_shards_is_read_beside_it(
        store_url, local_shards, tiny_tree, tmp_path):
    """A new job could not start while an old job on the node held the previous version of a re-uploaded
    store (ShardIntegrityError on the cached copy); the manifest's identity in the cache key keeps both."""
    old_local = fastload.LMDBImageDataset(local_shards)
    old = fastload.LMDBImageDataset(store_url, cache_dir=tmp_path / "cache")
    assert old.get_bytes(0) == old_local.get_bytes(0)  # shard 0 of version 1, held open by the old job
    tree = tmp_path / "tree"
    shutil.copytree(tiny_tree, tree)
    for f in sorted(tree.rglob("*.jpg"))[:2]:  # version 2: other files, same shard names
        f.unlink()
    new_local = sharded_store(tree, tmp_path / "v2", 3)
    assert [p.name for p in sorted(new_local.iterdir()) if p.is_dir()] == \
        [p.name for p in sorted(local_shards.iterdir()) if p.is_dir()]
    publish(new_local, store_url)
    new = fastload.LMDBImageDataset(store_url, cache_dir=tmp_path / "cache")
    new_ref = fastload.LMDBImageDataset(new_local)
    assert [new.get_bytes(i) for i in range(len(new))] == [new_ref.get_bytes(i) for i in range(len(new_ref))]
    assert new._reader.cache.key != old._reader.cache.key
    assert old.get_bytes(1) == old_local.get_bytes(1)  # the old job reads on from its own version
