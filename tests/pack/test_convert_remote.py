"""Sharded conversion from and to a real S3 server (tests/s3.py), through the CLI where a user would:
folder -> s3 store, s3 folder -> local store, a file list of keys, the driver killed and rerun,
the errors people meet named without a traceback, and `verify s3://...` naming a bad shard object."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from fastload.cli import main
from fastload.pack.convert import ConvertOptions
from fastload.pack.engines import EngineOptions, convert_sharded
from fastload.store import remote

OPTS = ConvertOptions(progress=False, lossless=True, workers=1)


def _files(dst: Path) -> dict[str, bytes]:
    return {str(p.relative_to(dst)): p.read_bytes() for p in sorted(dst.rglob("*")) if p.is_file()}


def _upload_tree(tree: Path, url: str) -> None:
    for p in sorted(tree.rglob("*")):
        if p.is_file() and not p.name.startswith("."):
            remote.upload_file(p, f"{url}/{p.relative_to(tree)}")


def _cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_folder_to_s3_then_verify_names_deleted_and_corrupted_shards(s3_server, fresh_bucket, tiny_tree, tmp_path):
    local = tmp_path / "local"
    convert_sharded(tiny_tree, local, OPTS, EngineOptions(num_shards=3))
    url = f"s3://{fresh_bucket}/imgs.store"
    r = _cli("convert", str(tiny_tree), url, "--num-shards", "3", "--lossless", "--workers", "1", "-q")
    assert r.exit_code == 0, r.output
    assert "stored 24 of 24 images" in r.output
    assert {u[len(url) + 1:]: remote.get_bytes(u) for u, _ in remote.list_prefix(url)} == _files(local)
    r = _cli("convert", str(tiny_tree), url, "--num-shards", "3", "--lossless", "--workers", "1", "-q")
    assert r.exit_code == 0 and "already complete" in r.output and "nothing to do" in r.output
    r = _cli("verify", url, "-q")
    assert r.exit_code == 0 and "3 shard objects checked" in r.output and "OK" in r.output
    gone, bad = f"{url}/shard-00000-of-00003/data.mdb", f"{url}/shard-00002-of-00003/data.mdb"
    remote.delete(gone)
    data = bytearray(remote.get_bytes(bad))
    data[len(data) // 2] ^= 0xFF
    remote.put_bytes(bad, bytes(data))
    labels = f"{url}/samples.json.gz"  # every label and path, beside the manifest: checked too
    remote.put_bytes(labels, remote.get_bytes(labels)[:-1])
    r = _cli("verify", url, "-q")
    assert r.exit_code == 1
    assert f"{gone}: missing" in r.output and f"{bad}: sha256" in r.output and "corrupted" in r.output
    assert f"{labels}: " in r.output and "the manifest says" in r.output
    assert "shard-00001" not in r.output and "3 problems" in r.output


def test_s3_folder_and_file_list_to_local(s3_server, fresh_bucket, tiny_tree, tmp_path):
    url = f"s3://{fresh_bucket}/tree"
    _upload_tree(tiny_tree, url)
    ref = tmp_path / "ref"
    convert_sharded(tiny_tree, ref, OPTS, EngineOptions(num_shards=2))
    dst = tmp_path / "from-s3"
    r = _cli("convert", url + "/", str(dst), "--num-shards", "2", "--lossless", "--workers", "1", "-q")
    assert r.exit_code == 0, r.output
    ours, theirs = _files(dst), _files(ref)
    assert ours.keys() == theirs.keys()
    # same samples, same order; only the source recorded in each shard's header differs (a URL)
    from fastload.store.reader import StoreReader

    a, b = StoreReader(dst), StoreReader(ref)
    assert [a.get(i) for i in range(len(a))] == [b.get(i) for i in range(len(b))]
    assert a.paths == b.paths and list(a.labels) == list(b.labels)
    # a file list whose paths are keys relative to the list's prefix
    classes = sorted(p.name for p in tiny_tree.iterdir() if p.is_dir())
    rows = ["path,label"] + [f"{c}/{p.name},{c}" for c in classes for p in sorted((tiny_tree / c).iterdir())][::2]
    remote.put_bytes(f"{url}/list.csv", "\n".join(rows).encode())
    r = _cli("convert", f"{url}/list.csv", str(tmp_path / "from-list"), "--lossless", "--workers", "1", "-q",
             "--engine", "local")
    assert r.exit_code == 0, r.output
    assert f"stored {len(rows) - 1} of {len(rows) - 1} images" in r.output


@pytest.mark.parametrize("case", ["credentials", "bucket", "endpoint"])
def test_remote_errors_are_named_without_traceback(s3_server, fresh_bucket, tiny_tree, monkeypatch, case,
                                                    refused_endpoint):
    bucket = fresh_bucket
    if case == "credentials":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    elif case == "bucket":
        bucket = "no-such-bucket-at-all"
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", refused_endpoint)
    url = f"s3://{bucket}/store"
    r = CliRunner().invoke(main, ["convert", str(tiny_tree), url, "-q", "--workers", "1"])
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output and f"Error: {url}" in r.output and "HINT:" in r.output
    expect = {"credentials": "wrong or missing credentials", "bucket": "bucket 'no-such-bucket-at-all' does not exist",
              "endpoint": "cannot reach the endpoint"}[case]
    assert expect in r.output


@pytest.mark.slow
def test_driver_killed_and_rerun_resumes(s3_server, fresh_bucket, tiny_tree, tmp_path):
    ref = tmp_path / "ref"
    convert_sharded(tiny_tree, ref, OPTS, EngineOptions(num_shards=6))
    url = f"s3://{fresh_bucket}/store"
    cmd = [sys.executable, "-m", "fastload.cli", "convert", str(tiny_tree), url, "--num-shards", "6",
           "--lossless", "--workers", "1", "-q"]
    root = str(Path(__file__).parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    deadline = time.monotonic() + 120
    while not [u for u, _ in remote.list_prefix(url) if u.endswith("data.mdb")]:
        assert proc.poll() is None and time.monotonic() < deadline, "conversion ended before the kill"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    published = [u for u, _ in remote.list_prefix(url) if u.endswith("data.mdb")]
    assert remote.head(f"{url}/manifest.json") is None and 0 < len(published) < 6
    r = _cli("convert", str(tiny_tree), url, "--num-shards", "6", "--lossless", "--workers", "1", "-q")
    assert r.exit_code == 0, r.output
    assert "resumed after" in r.output
    assert {u[len(url) + 1:]: remote.get_bytes(u) for u, _ in remote.list_prefix(url)} == _files(ref)


def test_verify_wrong_bucket_or_empty_prefix_says_so(s3_server, fresh_bucket):
    r = CliRunner().invoke(main, ["verify", "s3://no-such-bucket-at-all/x", "-q"])
    assert r.exit_code == 1 and "bucket 'no-such-bucket-at-all' does not exist" in r.output, r.output
    assert "has not finished" not in r.output
    r = CliRunner().invoke(main, ["verify", f"s3://{fresh_bucket}/nothing-here", "-q"])
    assert r.exit_code == 1 and "nothing at this URL" in r.output, r.output


def test_object_overwritten_with_same_size_between_crash_and_rerun_is_named(s3_server, fresh_bucket, tiny_tree,
                                                                            tmp_path, monkeypatch):
    from fastload.errors import ConvertError, SourceReadError

    url = f"s3://{fresh_bucket}/tree"
    classes = sorted(p.name for p in tiny_tree.iterdir() if p.is_dir())[:2]
    for c in classes:
        for k, f in enumerate(sorted((tiny_tree / c).glob("*.jpg"))[:3]):
            remote.upload_file(f, f"{url}/{c}/{'flaky_' if k == 2 else ''}{f.name}")
    fault = tmp_path / "fault"
    fault.touch()
    monkeypatch.setenv("FASTLOAD_TEST_FAULT", str(fault))
    dst, handler = tmp_path / "dst", "flaky_read_handler:prepare_item"
    with pytest.raises(SourceReadError):  # the "crash": plan.json written, no manifest
        convert_sharded(url, dst, OPTS, EngineOptions(num_shards=2), handler=handler)
    fault.unlink()
    victim = f"{url}/{classes[0]}/{sorted((tiny_tree / classes[0]).glob('*.jpg'))[0].name}"
    data = bytearray(remote.get_bytes(victim))
    data[-3] ^= 0x01  # same size, other bytes
    remote.put_bytes(victim, bytes(data))
    with pytest.raises(ConvertError, match=r"(?s)were added, removed or changed.*changed: a file of "
                                           r"shard-00000-of-00002"):
        convert_sharded(url, dst, OPTS, EngineOptions(num_shards=2), handler=handler)
    assert not (dst / "manifest.json").exists()


@pytest.fixture
def store_in_bucket(s3_server, fresh_bucket, tiny_tree):
    url = f"s3://{fresh_bucket}/store"
    convert_sharded(tiny_tree, url, OPTS, EngineOptions(num_shards=3))
    assert _cli("verify", url, "-q").exit_code == 0
    return url


def _edit_manifest(url: str, **changes) -> None:
    import dataclasses

    from fastload.store.manifest import Manifest

    m = Manifest.from_json(remote.get_bytes(f"{url}/manifest.json"))
    remote.put_bytes(f"{url}/manifest.json", dataclasses.replace(m, **changes).to_json().encode())


def test_class_names_permuted_in_the_manifest_are_named_by_verify_and_the_reader(store_in_bucket, tmp_path):
    """ds.classes handed every label out with another class's name, and `verify s3://` said OK."""
    from fastload.errors import ManifestError
    from fastload.load.dataset import LMDBImageDataset
    from fastload.store.manifest import Manifest

    url = store_in_bucket
    classes = list(Manifest.from_json(remote.get_bytes(f"{url}/manifest.json")).classes)
    _edit_manifest(url, classes=tuple(classes[1:] + classes[:1]))
    r = _cli("verify", url, "-q")
    assert r.exit_code == 1, r.output
    assert (f"{url}/shard-00000-of-00003/data.mdb: class 0 is {classes[0]!r} in the shard, {classes[1]!r} in "
            "manifest.json") in r.output and "3 problems" in r.output
    ds = LMDBImageDataset(url, cache_dir=tmp_path / "cache")
    with pytest.raises(ManifestError, match=rf"class 0 is {classes[1]!r} in the manifest, {classes[0]!r} in the "
                                            r"shard .*\nHINT: ") as exc:
        ds[len(ds) - 1]  # whichever shard is opened first
    assert "fastload verify" in str(exc.value)


def test_a_labels_object_whose_labels_differ_from_the_shards_fails_verify(store_in_bucket):
    """samples.json.gz rewritten with every label changed and the manifest made to name it: `verify` passed."""
    from fastload.store.manifest import Manifest, parse_samples, samples_object

    url = store_in_bucket
    m = Manifest.from_json(remote.get_bytes(f"{url}/manifest.json"))
    labels, paths = parse_samples(remote.get_bytes(f"{url}/samples.json.gz"), m)
    data, entry = samples_object([(y + 1) % len(m.classes) for y in labels], paths)
    remote.put_bytes(f"{url}/samples.json.gz", data)
    _edit_manifest(url, samples=entry)
    r = _cli("verify", url, "-q")
    assert r.exit_code == 1, r.output
    for i, e in enumerate(m.shards):
        assert (f"{url}/{e.name}/data.mdb: {e.count} of its {e.count} samples have another label or path in "
                f"samples.json.gz, e.g. sample {e.start} ({paths[e.start]}): label {labels[e.start]} in the shard, "
                f"{(labels[e.start] + 1) % 3} ({paths[e.start]}) in samples.json.gz") in r.output, r.output
