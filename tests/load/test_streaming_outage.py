"""The endpoint going away (issue #25): retries with backoff within the retry budget, then a clear error
naming the URL. A SeaweedFS server of each test's own (``s3.start_server``), stopped and restarted on
the same ports and data; the session's shared server is not touched.

After its *first* restart, ``weed mini`` answers 500, and for about a second 404 NoSuchKey for
objects it holds, for a few seconds after its S3 port opens (seen in the first of 4 stop/start cycles,
in each of two probes; later restarts were mostly clean, but once, under load, a later one did the same
and failed the epoch). A 404 is retried only by a download that met the endpoint away first (a deleted
shard must be a named error at once); the outage test restarts its server once before the measured
outage, so the outage it measures is the usual one."""

from __future__ import annotations

import gc
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch

import fastload
from fastload.errors import RemoteStoreError
from fastload.store import remote
from fastload.store.cache import node_downloads
from remote_helpers import publish, sharded_store
from s3 import start_server

pytestmark = pytest.mark.slow

SHARDS = 6


@pytest.fixture
def own_server(tmp_path, monkeypatch):
    server = start_server(tmp_path / "weed", restartable=True)
    try:
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_ALLOW_HTTP", remote.RETRY_ENV):
            monkeypatch.delenv(name, raising=False)
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        yield server
    finally:
        server.stop()


@pytest.fixture
def published(own_server, tiny_tree, tmp_path):
    local = sharded_store(tiny_tree, tmp_path / "store", SHARDS)
    own_server.make_bucket("outage")
    url = own_server.url("outage", "store/")
    publish(local, url)
    return local, url


def _loader(path, **kw):
    ds = fastload.LMDBImageDataset(path, transform=fastload.eval_transform(size=32), **kw)
    # window=1: one shard read at a time and one prefetched, so most downloads come after the stop
    return ds, fastload.DataLoader(ds, batch_size=4, sampler=fastload.ShardSampler(ds, seed=0, window=1),
                                   num_workers=0)


def _reads_every_shard(server, ds, within: float = 60.0) -> bool:
    """Until the server itself (not through the proxy) serves every shard object; False after ``within`` s."""
    import obstore
    from obstore.store import S3Store

    from s3 import ACCESS_KEY, REGION, SECRET_KEY

    # each request bounded (a restarting server may accept a connection and not answer it: without a limit
    # the probe waited 30 s on it and called a server that served the client at once "not serving")
    store = S3Store("outage", endpoint=server.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                    region=REGION, client_options={"allow_http": True, "timeout": "3s", "connect_timeout": "1s"},
                    retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=1)})
    deadline = time.monotonic() + within
    for spec in ds._reader.specs:
        key = spec.url.split("/", 3)[3]
        while True:
            try:
                obstore.get(store, key).bytes()
                break
            except Exception:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.1)
    return True


# The default budget. Before the reads' stall limit (remote.stall_limit(), FASTLOAD_REMOTE_STALL_S) the outage was not ridden out with it
# in 2 of ~8 runs beside two CPU burners and once in CI (a request that connected while the server came back
# could wait out the 300 s request timeout); the test then used 60 s
OUTAGE_BUDGET_S = remote.RETRY_BUDGET_S


def test_endpoint_down_10s_mid_epoch_is_ridden_out(own_server, published, tmp_path, monkeypatch):
    assert remote.retry_budget() == OUTAGE_BUDGET_S  # the default: own_server cleared FASTLOAD_REMOTE_RETRY_S
    local, url = published
    expected = list(_loader(local)[1])
    ds, loader = _loader(url, cache_dir=tmp_path / "cache")
    own_server.stop()  # the first restart, not measured (the module docstring says why)
    own_server.start()
    own_server.wait_ready()
    assert _reads_every_shard(own_server, ds), "the restarted server does not serve the store's shards"
    times: dict[str, float] = {}

    def outage() -> None:
        time.sleep(10)
        times["restart"] = time.time()
        try:
            for attempt in range(3):  # the same ports and data
                own_server.start()
                own_server.wait_ready()
                # a restarted weed mini has come back answering but not serving the objects it holds (its S3
                # gateway failing to reach its filer, in one CI run): an operator restarts such a server
                if _reads_every_shard(own_server, ds, within=4.0):
                    times["back"] = time.time()
                    return
                times[f"restart {attempt + 1} did not serve"] = time.time()
                own_server.stop()
        except Exception as exc:  # said below, with the server's log
            times["failed"] = repr(exc)

    got, thread, error = [], threading.Thread(target=outage), None
    try:
        for x, y in loader:
            got.append((x, y))
            if len(got) == 1:  # mid-epoch: the first shard read, the rest not yet downloaded
                own_server.stop()
                times["stopped"] = time.time()
                thread.start()
    except RemoteStoreError as exc:
        error = exc
    finally:
        if thread.ident is not None:
            thread.join()
    if error is not None:
        # the server's failure, not the client's, shows nothing about the client: a server that did not come
        # back in time (a loaded machine once took 31 s), or one that came back and then stopped serving.
        # Under load a restarted `weed mini` served every shard, then its filer and volume server stopped on
        # their own within 3 s ("Filer stopped" in its log, GETs answered "all filers failed", then its S3
        # port closed): 2 of 8 runs beside a CPU burner and a CI run; the client's error then was right
        if "back" not in times or times["back"] - times["stopped"] >= OUTAGE_BUDGET_S - 5 \
                or not _reads_every_shard(own_server, ds, within=5.0):
            pytest.skip(f"the restarted SeaweedFS was not serving its objects when the client gave up ({error}): "
                        f"{times}; its log: {own_server.log.read_text()[-1500:] if own_server.log else ''}")
        raise error
    away = times["restart"] - times["stopped"]
    assert away >= 10, f"the server was away {away:.1f} s"
    # the epoch is whole and exact: the same batches as from the local shards, in the same order
    assert len(got) == len(expected)
    for (x, y), (ex, ey) in zip(got, expected):
        assert torch.equal(y, ey) and torch.equal(x, ex)
    log = node_downloads(tmp_path / "cache")
    assert sorted(d["shard"] for d in log) == sorted({d["shard"] for d in log}) and len(log) == SHARDS
    assert any(d["time"] > times["restart"] for d in log), "no download waited for the server: the test saw no outage"
    assert not any((tmp_path / "cache" / ds._reader.cache.key / ".partial").iterdir())


@pytest.mark.parametrize("workers", [0, 2])
def test_endpoint_gone_past_the_budget_is_a_named_error(own_server, published, tmp_path, monkeypatch, workers):
    _local, url = published
    budget = 5
    monkeypatch.setenv(remote.RETRY_ENV, str(budget))
    # the manifest is read while the server is up
    ds = fastload.LMDBImageDataset(url, transform=fastload.eval_transform(size=32), cache_dir=tmp_path / "cache")
    own_server.stop()

    def first_error() -> tuple[RemoteStoreError, float]:
        """The error, and when it came. With workers, the loader is then let go as a training loop that
        meets the error lets it go: torch stops its workers, and kills (SIGTERM) one that does not stop
        within 5 s (one still retrying a download, in a child process that must stop with it)."""
        t0 = time.monotonic()
        it = iter(fastload.DataLoader(ds, batch_size=4, num_workers=workers)) if workers else None
        try:
            # forked workers download in child processes: the budget reaches them through the env
            next(it) if it is not None else ds.get_bytes(0)
        except RemoteStoreError as exc:
            exc.__traceback__ = None  # its frames hold the iterator: returning lets the loader go
            return exc, time.monotonic() - t0
        raise AssertionError("no error with the endpoint gone")

    error, took = first_error()
    gc.collect()  # a reference cycle may still hold the iterator: let it go now, as it would be eventually
    text = str(error)
    assert "/data.mdb" in text and url in text, text
    assert f"cannot reach the endpoint ({own_server.endpoint}) from node {socket.gethostname()}, retried for " \
           f"{budget} s" in text, text
    assert "HINT: check AWS_ENDPOINT_URL" in text and remote.RETRY_ENV in text, text
    # retried for the budget (not given up at once), then stopped: the last backoff (<= 2 s) is the slack.
    # Workers: a worker queued on another's download of the same shard meets its failure (not a budget of
    # its own after it: that was 2 budgets here, 8 with 8 workers); each download process starts an interpreter
    assert budget <= took < (budget + 5 if not workers else budget + 8), took
    root = tmp_path / "cache" / ds._reader.cache.key
    # nothing partial left once every download has given up or was stopped with its worker (the other
    # worker's and the prefetcher's may still be retrying when the first error arrives; the prefetches
    # queued behind a failed one are dropped)
    deadline = time.monotonic() + budget + 10
    while any((root / ".partial").iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any((root / ".partial").iterdir())
    assert not [s.name for s in ds._reader.specs if (root / s.name).exists()]  # nothing partial, nothing half-published
