"""store/remote.py against a real S3 server (tests/s3.py): URLs, each operation, and the errors
people meet (wrong credentials, missing bucket, unreachable endpoint) named in one line."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from fastload.errors import RemoteStoreError
from fastload.store import remote


def test_is_remote_and_parse():
    assert remote.is_remote("s3://b/p/") and remote.is_remote("gs://b") and remote.is_remote("az://c/x")
    assert not remote.is_remote("/tmp/x") and not remote.is_remote("relative/s3://x")
    assert not remote.is_remote("C:\\data\\store") and not remote.is_remote("C:/data/store")
    assert not remote.is_remote("./s3:/x") and not remote.is_remote("s3:bucket")
    loc = remote.RemoteLocation.parse("s3://bucket/a/b/")
    assert (loc.scheme, loc.bucket, loc.prefix) == ("s3", "bucket", "a/b")
    assert str(loc.child("manifest.json")) == "s3://bucket/a/b/manifest.json"
    assert str(remote.RemoteLocation.parse("s3://bucket").child("x")) == "s3://bucket/x"
    assert loc.child("shard-00000-of-00002/data.mdb").name == "data.mdb"
    with pytest.raises(RemoteStoreError, match="not an object-store URL"):
        remote.RemoteLocation.parse("ftp://b/x")


@pytest.mark.parametrize("url, why", [
    ("s3://", "no bucket after s3://"), ("s3:///x", "no bucket after s3://"), ("gs:///", "no bucket after gs://"),
    ("S3://bucket/x", "written in lower case"), ("http://host/x", "http:// is not a supported scheme"),
    ("ftp://host/x", "ftp:// is not a supported scheme"), ("file:///tmp/x", "file:// is not a supported scheme"),
    ("https://bucket.s3.amazonaws.com/x", "https:// is not a supported scheme")])
def test_a_string_that_looks_like_a_url_is_a_supported_one_or_an_error_naming_them(url, why):
    """Never a local path: ``is_remote`` (the one test every room uses) refuses it, naming the schemes."""
    with pytest.raises(RemoteStoreError, match=why) as exc:
        remote.is_remote(url)
    assert "s3://, s3a://, gs://, az://" in str(exc.value) and "HINT" in str(exc.value)


def test_operations_round_trip(s3_server, fresh_bucket, tmp_path):
    base = f"s3://{fresh_bucket}/dir"
    remote.put_bytes(f"{base}/a.bin", b"hello")
    assert remote.get_bytes(f"{base}/a.bin") == b"hello"
    assert remote.head(f"{base}/a.bin") == 5
    assert remote.head(f"{base}/none.bin") is None
    big = tmp_path / "big.bin"
    payload = bytes(range(256)) * (20 * 4096 + 7)  # ~21 MB: a multipart upload
    big.write_bytes(payload)
    remote.upload_file(big, f"{base}/sub/big.bin")
    assert remote.head(f"{base}/sub/big.bin") == len(payload)
    out = tmp_path / "back.bin"
    assert remote.download_file(f"{base}/sub/big.bin", out) == len(payload)
    assert out.read_bytes() == payload
    assert remote.list_prefix(base) == [(f"{base}/a.bin", 5), (f"{base}/sub/big.bin", len(payload))]
    assert remote.list_prefix(f"s3://{fresh_bucket}/di") == []  # a prefix is a folder, not a string prefix
    remote.delete(f"{base}/a.bin")
    remote.delete(f"{base}/a.bin")  # already gone: fine
    assert remote.head(f"{base}/a.bin") is None
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no partial download left


def test_missing_object_is_named(s3_server, fresh_bucket):
    url = f"s3://{fresh_bucket}/nothing/here.bin"
    with pytest.raises(RemoteStoreError) as err:
        remote.get_bytes(url)
    assert err.value.reason == "missing" and str(err.value).startswith(url) and "HINT:" in str(err.value)


def test_wrong_credentials_are_named(s3_server, fresh_bucket, monkeypatch):
    remote.put_bytes(f"s3://{fresh_bucket}/x", b"1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(RemoteStoreError) as err:
        remote.get_bytes(f"s3://{fresh_bucket}/x")
    assert err.value.reason == "credentials"
    assert f"s3://{fresh_bucket}/x" in str(err.value) and "AWS_SECRET_ACCESS_KEY" in str(err.value)


def test_missing_bucket_is_named(s3_server):
    with pytest.raises(RemoteStoreError) as err:
        remote.list_prefix("s3://no-such-bucket-here/p")
    assert err.value.reason == "bucket" and "no-such-bucket-here" in str(err.value)
    with pytest.raises(RemoteStoreError) as err:
        remote.put_bytes("s3://no-such-bucket-here/p/x", b"1")
    assert err.value.reason == "bucket"


def test_unreachable_endpoint_is_named(monkeypatch, refused_endpoint):
    monkeypatch.setenv("AWS_ENDPOINT_URL", refused_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    with pytest.raises(RemoteStoreError) as err:
        remote.get_bytes("s3://bucket/key")
    assert err.value.reason == "endpoint" and refused_endpoint in str(err.value), str(err.value)
    assert "s3://bucket/key" in str(err.value)
    assert f"from node {socket.gethostname()}" in str(err.value)  # on a cluster: which node could not reach it


@pytest.fixture
def silent_endpoint(monkeypatch):
    """``http://127.0.0.1:PORT`` where connections are accepted and never answered (a hung server, or one
    that has its port back but does not serve yet); the stall limit cut to 1 s, the budget to 3 s."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    for name, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{srv.getsockname()[1]}", "AWS_ACCESS_KEY_ID": "k",
                        "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1", remote.RETRY_ENV: "3"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(remote.STALL_ENV, "1")
    monkeypatch.setattr(remote, "_STORES", {})
    try:
        yield held
    finally:
        srv.close()
        for c in held:
            c.close()


@pytest.mark.parametrize("op", ["get_bytes", "get_range", "stat", "list_objects", "download_file"])
def test_a_server_that_never_answers_is_asked_again_then_named(silent_endpoint, tmp_path, op):
    """Without a limit on silence, each of these waited for the whole request timeout (300 s), not retried."""
    call = {"get_bytes": lambda: remote.get_bytes("s3://bucket/key"),
            "get_range": lambda: remote.get_range("s3://bucket/key", 0, 10),
            "stat": lambda: remote.stat("s3://bucket/key"),
            "list_objects": lambda: remote.list_objects("s3://bucket/key"),
            "download_file": lambda: remote.download_file("s3://bucket/key", tmp_path / "out")}[op]
    out: dict = {}

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 (said below)
            out["error"] = exc

    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), f"{op} still waits on a server that never answers after 30 s"
    took = time.monotonic() - t0
    error = out.get("error")
    assert isinstance(error, RemoteStoreError) and error.reason == "endpoint", repr(error)
    assert "s3://bucket/key" in str(error)
    assert len(silent_endpoint) >= 2, "asked once: not again on a new connection"
    assert 3 <= took < 3 + 1 + 5, took  # the budget, then at most one more silence and a backoff
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def _answers(monkeypatch, *answers):
    """remote._stream_to replaced by a server that gives ``answers`` in turn (an exception, or bytes)."""
    calls = []

    def stream_to(loc, tmp):
        answer = answers[min(len(calls), len(answers) - 1)]
        calls.append(answer)
        if isinstance(answer, BaseException):
            raise answer
        tmp.write_bytes(answer)
        return len(answer)

    monkeypatch.setattr(remote, "_stream_to", stream_to)
    monkeypatch.setattr(remote, "_drop_store", lambda loc, attempt_s: None)
    monkeypatch.setenv(remote.RETRY_ENV, "5")
    return calls


GONE = OSError("Generic S3 error: Error performing GET http://127.0.0.1:1/b/k - HTTP error: error sending request")
NO_SUCH = FileNotFoundError("Object at location k not found: NoSuchKey")


def test_a_download_asks_again_when_a_server_back_from_an_outage_says_no_such_object(monkeypatch, tmp_path):
    # SeaweedFS, for a second after a restart, answered 404 NoSuchKey for objects it held
    calls = _answers(monkeypatch, GONE, NO_SUCH, NO_SUCH, b"shard")
    assert remote.download_file("s3://b/k", tmp_path / "out") == 5 and len(calls) == 4
    assert (tmp_path / "out").read_bytes() == b"shard"


def test_a_download_that_finds_no_object_fails_at_once_and_after_an_outage_within_the_budget(monkeypatch, tmp_path):
    calls = _answers(monkeypatch, NO_SUCH)
    t0 = time.monotonic()
    with pytest.raises(RemoteStoreError) as err:
        remote.download_file("s3://b/k", tmp_path / "out")
    assert err.value.reason == "missing" and len(calls) == 1 and time.monotonic() - t0 < 1  # never asked again
    calls = _answers(monkeypatch, GONE, NO_SUCH)
    t0 = time.monotonic()
    with pytest.raises(RemoteStoreError) as err:  # still missing once the endpoint is back: named when the budget ends
        remote.download_file("s3://b/k", tmp_path / "out")
    assert err.value.reason == "missing" and "s3://b/k" in str(err.value), str(err.value)
    assert 5 <= time.monotonic() - t0 < 8 and len(calls) > 3
    assert not (tmp_path / "out").exists()


def test_retry_budget_default_and_from_the_environment(monkeypatch):
    monkeypatch.delenv(remote.RETRY_ENV, raising=False)
    assert remote.retry_budget() == remote.RETRY_BUDGET_S == 30
    config = remote.retry_config(30)
    assert config["retry_timeout"].total_seconds() == 30 and config["max_retries"] * 0.1 >= 30  # time binds, not the count
    monkeypatch.setenv(remote.RETRY_ENV, "7.5")
    assert remote.retry_budget() == 7.5
    for bad in ("soon", "-1", "inf", "nan"):
        monkeypatch.setenv(remote.RETRY_ENV, bad)
        with pytest.raises(ValueError, match=rf"{remote.RETRY_ENV}.*seconds >= 0"):
            remote.retry_budget()


def test_error_survives_pickling():
    import pickle

    e = pickle.loads(pickle.dumps(RemoteStoreError("s3://b/k: x", url="s3://b/k", reason="bucket")))
    assert (str(e), e.url, e.reason) == ("s3://b/k: x", "s3://b/k", "bucket")


def test_server_listens_on_loopback_only(s3_server):
    import psutil

    procs = [psutil.Process(s3_server.proc.pid)]
    procs += procs[0].children(recursive=True)
    listening = [c.laddr for p in procs for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening and all(a.ip == "127.0.0.1" for a in listening), listening


def test_head_on_a_missing_bucket_names_the_bucket(s3_server):
    # S3 answers HEAD with a bare 404 (no body, no NoSuchBucket): a typo in the bucket must not read as "no object"
    with pytest.raises(RemoteStoreError) as err:
        remote.head("s3://no-such-bucket-here/x/manifest.json")
    assert err.value.reason == "bucket" and "no-such-bucket-here" in str(err.value)


def test_listing_reports_a_version_that_changes_on_same_size_overwrite(s3_server, fresh_bucket):
    url = f"s3://{fresh_bucket}/v/a.bin"
    remote.put_bytes(url, b"one")
    (_, size, before), = remote.list_objects(f"s3://{fresh_bucket}/v")
    remote.put_bytes(url, b"two")
    (_, size2, after), = remote.list_objects(f"s3://{fresh_bucket}/v")
    assert size == size2 == 3 and before and before != after
    assert remote.stat(url) == (3, after)


@pytest.mark.parametrize("text, reason", [
    ("error sending request for url (http://127.0.0.1:40412/b/store/data.mdb): operation timed out", "endpoint"),
    ("error sending request for url (http://127.0.0.1:8333/t404-1/x): connection refused", "endpoint"),
    ("Generic S3 error: Client error with status 404 Not Found: <Error><Code>NoSuchKey</Code></Error>", "missing"),
    ("Generic S3 error: request failed, status: 404", "missing"),
], ids=["port-40412", "bucket-t404", "404-not-found", "status-404"])
def test_a_404_in_the_url_is_not_a_missing_object(text, reason):
    """Every error message holds the URL: a port or bucket name with the digits 404 in it is not an HTTP 404
    (a stalled download against port 40412 was called "no such object" and not retried)."""
    err = remote._error(remote.RemoteLocation.parse("s3://t404-1/x"), "downloading", Exception(text))
    assert err.reason == reason, str(err)


BAD_URLS = ["s3://", "s3:///x", "S3://bucket/x", "http://host/x", "ftp://host/x", "file:///tmp/x"]


@pytest.mark.parametrize("url", BAD_URLS)
def test_readers_refuse_a_url_that_is_not_a_supported_one(url, tmp_path, monkeypatch):
    """LMDBImageDataset (with or without cache_dir) and StoreReader name the supported schemes, not a
    ValueError about cache_dir or a missing local folder."""
    from fastload.load.dataset import LMDBImageDataset
    from fastload.store.reader import StoreReader

    monkeypatch.chdir(tmp_path)
    for make in (lambda: LMDBImageDataset(url), lambda: LMDBImageDataset(url, cache_dir=tmp_path / "cache"),
                 lambda: StoreReader(url)):
        with pytest.raises(RemoteStoreError, match="not an object-store URL") as exc:
            make()
        assert "s3://" in str(exc.value)
    assert list(tmp_path.iterdir()) == []


def test_store_reader_sends_a_bucket_url_to_the_remote_reader():
    from fastload.errors import NotAStoreError
    from fastload.store.reader import StoreReader

    with pytest.raises(NotAStoreError, match="LMDBImageDataset"):
        StoreReader("s3://bucket/store")


@pytest.mark.parametrize("url", BAD_URLS)
@pytest.mark.parametrize("as_src", [False, True])
def test_convert_to_or_from_a_url_that_is_not_a_supported_one_writes_nothing(url, as_src, tiny_tree, tmp_path,
                                                                             monkeypatch):
    """Each exited 0 having written a local store named ``s3:``, ``S3:``, ``http:`` ... in the working folder."""
    from click.testing import CliRunner

    from fastload.cli import main

    monkeypatch.chdir(tmp_path)
    args = [url, "dst"] if as_src else [str(tiny_tree), url]
    for extra in ([], ["--engine", "local"], ["--num-shards", "2"], ["--shard-size", "4MB"]):
        r = CliRunner().invoke(main, ["convert", *args, "--lossless", "-q", *extra], catch_exceptions=False)
        assert r.exit_code == 1, r.output
        assert "not an object-store URL" in r.output and "s3://" in r.output and "Traceback" not in r.output
    assert list(tmp_path.iterdir()) == []
    for cmd in (["verify", url], ["inspect", url]):
        r = CliRunner().invoke(main, cmd, catch_exceptions=False)
        assert r.exit_code == 1 and "not an object-store URL" in r.output, r.output


def test_missing_credentials_are_named_at_once(monkeypatch):
    """No credentials at all were reported as "cannot reach the endpoint" after ~10 s (obstore asked an EC2
    metadata endpoint that is not there); now at once, naming the variables read, with no request made."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.setblocking(False)
    for name in remote.AWS_CREDENTIAL_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{srv.getsockname()[1]}")
    monkeypatch.setenv(remote.RETRY_ENV, "1")
    monkeypatch.setattr(remote, "_EC2_MARKS", ())  # whatever machine runs the test
    monkeypatch.setattr(remote, "_STORES", {})
    try:
        for op in (lambda: remote.get_bytes("s3://bucket/key"), lambda: remote.stat("s3://bucket/key")):
            with pytest.raises(RemoteStoreError, match=r"s3://bucket/key: no credentials found: .*AWS_ACCESS_KEY_ID, "
                                                       r"AWS_SECRET_ACCESS_KEY.*none of them is set.*\nHINT: export "
                                                       r"AWS_ACCESS_KEY_ID") as err:
                op()
            assert err.value.reason == "credentials"
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")  # half a pair
        with pytest.raises(RemoteStoreError, match="AWS_SECRET_ACCESS_KEY is not set"):
            remote.get_bytes("s3://bucket/key")
        with pytest.raises(BlockingIOError):
            srv.accept()  # nothing was asked of the endpoint
    finally:
        srv.close()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")  # a pair: the endpoint is asked (closed now: refused)
    with pytest.raises(RemoteStoreError) as err:
        remote.get_bytes("s3://bucket/key")
    assert err.value.reason == "endpoint", str(err.value)


def test_the_stall_limit_is_an_option_beside_the_retry_budget(monkeypatch):
    """docs/streaming.md teaches FASTLOAD_REMOTE_STALL_S, read in one place as the budget is."""
    monkeypatch.delenv(remote.STALL_ENV, raising=False)
    assert remote.stall_limit() == remote.STALL_S == 10.0
    monkeypatch.setenv(remote.STALL_ENV, "2.5")
    assert remote.stall_limit() == 2.5
    for bad in ("0", "-1", "soon", "inf"):
        monkeypatch.setenv(remote.STALL_ENV, bad)
        with pytest.raises(ValueError, match=f"Unknown value '{bad}' for FASTLOAD_REMOTE_STALL_S.*> 0"):
            remote.stall_limit()
    monkeypatch.setenv(remote.RETRY_ENV, "0")
    assert remote.retry_budget() == 0.0
