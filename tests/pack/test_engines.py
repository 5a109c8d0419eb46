"""Sharded conversion (pack/engines.py): deterministic placement, resume, refusal, local and remote DST."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastload.errors import ConvertError, IncompleteStoreError
from fastload.pack.convert import ConvertOptions
from fastload.pack.engines import EngineOptions, convert_sharded, parse_size
from fastload.store.manifest import Manifest, parse_samples
from fastload.store.reader import StoreReader

OPTS = ConvertOptions(progress=False, lossless=True, workers=1)


def _files(dst: Path) -> dict[str, bytes]:
    return {str(p.relative_to(dst)): p.read_bytes() for p in sorted(dst.rglob("*")) if p.is_file()}


def test_parse_size():
    assert parse_size("64MB") == 64_000_000 and parse_size("1GiB") == 2**30 and parse_size("512k") == 512_000
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def test_sharded_store_is_the_plain_store_split(tiny_tree, tiny_store, tmp_path):
    dst = tmp_path / "dst"
    report = convert_sharded(tiny_tree, dst, OPTS, EngineOptions(num_shards=3))
    assert (report.stored, report.total, report.skipped) == (24, 24, [])
    assert sorted(p.name for p in dst.iterdir()) == ["manifest.json", "plan.json", "samples.json.gz",
                                                     "shard-00000-of-00003", "shard-00001-of-00003",
                                                     "shard-00002-of-00003"]
    assert all(sorted(q.name for q in (dst / f"shard-0000{i}-of-00003").iterdir()) == ["data.mdb"] for i in range(3))
    manifest = Manifest.from_json((dst / "manifest.json").read_text())
    assert [(s.start, s.count) for s in manifest.shards] == [(0, 8), (8, 8), (16, 8)]
    sharded, plain = StoreReader(dst), StoreReader(tiny_store)
    assert len(sharded) == len(plain) and sharded.classes == plain.classes
    for i in range(len(plain)):
        assert sharded.get(i) == plain.get(i) and sharded.labels[i] == plain.labels[i]
    # every label and path, beside the manifest (what a remote store's targets/samples read)
    labels, paths = parse_samples((dst / "samples.json.gz").read_bytes(), manifest)
    assert labels == plain.labels.tolist() and paths == list(plain.paths)


def test_bytes_do_not_depend_on_workers_and_rerun_does_nothing(tiny_tree, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    convert_sharded(tiny_tree, a, OPTS, EngineOptions(shard_bytes=20_000))
    convert_sharded(tiny_tree, b, ConvertOptions(progress=False, lossless=True, workers=2),
                    EngineOptions(shard_bytes=20_000))
    assert len(json.loads((a / "manifest.json").read_text())["shards"]) > 2  # sized by bytes
    assert _files(a) == _files(b)
    again = convert_sharded(tiny_tree, a, OPTS, EngineOptions(shard_bytes=20_000))
    assert again.already_complete and again.stored == 24 and "nothing to do" in again.summary_line()


def test_resume_redoes_only_missing_shards(tiny_tree, tmp_path):
    dst, ref = tmp_path / "dst", tmp_path / "ref"
    convert_sharded(tiny_tree, ref, OPTS, EngineOptions(num_shards=3))
    convert_sharded(tiny_tree, dst, OPTS, EngineOptions(num_shards=3))
    # as if the driver died after shard 1 was published: no manifest, shards 0 and 2 missing
    (dst / "manifest.json").unlink()
    for name in ("shard-00000-of-00003", "shard-00002-of-00003"):
        (dst / name / "data.mdb").unlink()
        (dst / name).rmdir()
    with pytest.raises(IncompleteStoreError):
        StoreReader(dst)
    before = (dst / "shard-00001-of-00003" / "data.mdb").stat().st_mtime_ns
    report = convert_sharded(tiny_tree, dst, OPTS, EngineOptions(num_shards=3))
    assert report.resumed_from == 8 and report.stored == 24
    assert (dst / "shard-00001-of-00003" / "data.mdb").stat().st_mtime_ns == before  # kept, not redone
    assert _files(dst) == _files(ref)


def test_other_options_on_existing_dst_name_the_difference(tiny_tree, tmp_path):
    dst = tmp_path / "dst"
    convert_sharded(tiny_tree, dst, OPTS, EngineOptions(num_shards=2))
    with pytest.raises(ConvertError, match="option encoding: 'jpeg' vs now 'raw'"):
        convert_sharded(tiny_tree, dst, ConvertOptions(progress=False, encoding="raw", workers=1),
                        EngineOptions(num_shards=2))
    with pytest.raises(ConvertError, match="option num_shards: 2 vs now 3"):
        convert_sharded(tiny_tree, dst, OPTS, EngineOptions(num_shards=3))


def test_skipped_files_are_named_across_shards(tiny_tree, tmp_path):
    import shutil

    tree = tmp_path / "tree"
    shutil.copytree(tiny_tree, tree)
    classes = sorted(p.name for p in tree.iterdir() if p.is_dir())
    (tree / classes[0] / "zz_broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    (tree / classes[-1] / "zz_empty.png").write_bytes(b"")
    report = convert_sharded(tree, tmp_path / "dst", OPTS, EngineOptions(num_shards=3))
    assert report.total == 26 and report.stored == 24
    assert sorted(s["relpath"] for s in report.skipped) == [f"{classes[0]}/zz_broken.jpg",
                                                             f"{classes[-1]}/zz_empty.png"]


def test_cli_refuses_contradicting_shard_options(tiny_tree, tmp_path):
    from click.testing import CliRunner

    from fastload.cli import main

    def run(*extra):
        return CliRunner().invoke(main, ["convert", str(tiny_tree), str(tmp_path / "dst"), "-q", *extra])

    r = run("--engine", "local", "--shard-index", "1", "--num-shards", "2")
    assert r.exit_code == 2 and "--shard-index" in r.output and "packs one shard by hand" in r.output
    r = run("--engine", "local", "--num-shards", "2", "--shard-size", "1MB")
    assert r.exit_code == 2 and "not both" in r.output
    r = run("--engine", "local", "--shard-size", "lots")
    assert r.exit_code == 2 and "not a size" in r.output
    r = run("--address", "auto")
    assert r.exit_code == 2 and "needs --engine ray" in r.output
    r = run("--engine", "local", "--strict")
    assert r.exit_code == 2 and "not available for sharded conversion" in r.output
    assert not (tmp_path / "dst").exists()  # nothing written by a refused command
    r = run("--engine", "local", "--shard-size", "40KB", "--workers", "1", "--lossless")
    assert r.exit_code == 0 and "stored 24 of 24 images" in r.output
    assert len(json.loads((tmp_path / "dst" / "manifest.json").read_text())["shards"]) > 3


def _six_file_tree(tiny_tree: Path, tree: Path) -> Path:
    """2 classes x 3 files of ``tiny_tree``; the second file of each class is named flaky_*."""
    import shutil

    for c in sorted(p.name for p in tiny_tree.iterdir() if p.is_dir())[:2]:
        (tree / c).mkdir(parents=True)
        for k, f in enumerate(sorted((tiny_tree / c).glob("*.jpg"))[:3]):
            shutil.copyfile(f, tree / c / (f"flaky_{f.name}" if k == 1 else f"a{k}_{f.name}"))
    return tree


def test_source_read_error_fails_the_shard_and_a_rerun_completes_it(tiny_tree, tmp_path, monkeypatch):
    from fastload.errors import SourceReadError

    tree = _six_file_tree(tiny_tree, tmp_path / "tree")
    ref, dst = tmp_path / "ref", tmp_path / "dst"
    convert_sharded(tree, ref, OPTS, EngineOptions(num_shards=2))
    fault = tmp_path / "fault"
    fault.touch()
    monkeypatch.setenv("FASTLOAD_TEST_FAULT", str(fault))
    with pytest.raises(SourceReadError, match=r"flaky_.*reading it failed: RemoteStoreError.*SlowDown"):
        convert_sharded(tree, dst, OPTS, EngineOptions(num_shards=2), handler="flaky_read_handler:prepare_item")
    assert not (dst / "manifest.json").exists()  # not sealed with the files missing
    assert not [p for p in dst.iterdir() if p.name.startswith("shard-")]  # no shard published without them
    fault.unlink()  # the throttling is over: the same command finishes, with every file
    report = convert_sharded(tree, dst, OPTS, EngineOptions(num_shards=2), handler="flaky_read_handler:prepare_item")
    assert (report.stored, report.skipped) == (6, [])
    assert _files(dst) == _files(ref)


def test_address_with_a_local_src_or_dst_needs_shared_fs(tiny_tree, tmp_path):
    from click.testing import CliRunner

    from fastload.cli import main

    dst = tmp_path / "dst"
    for args in ([str(tiny_tree), str(dst)], [str(tiny_tree), "s3://bucket/x"]):
        r = CliRunner().invoke(main, ["convert", *args, "--engine", "ray", "--address", "ray://127.0.0.1:1", "-q"])
        assert r.exit_code == 2 and "--shared-fs" in r.output and "other machines" in r.output, r.output
    r = CliRunner().invoke(main, ["convert", str(tiny_tree), str(dst), "--shared-fs", "-q"])
    assert r.exit_code == 2 and "only means something with --engine ray --address" in r.output
    with pytest.raises(ConvertError, match=r"(?s)SRC .* and DST .* are local paths.*--shared-fs"):
        convert_sharded(tiny_tree, dst, OPTS, EngineOptions(engine="ray", address="ray://127.0.0.1:1"))
    assert not dst.exists()  # refused before anything was written or any cluster joined


def test_a_shard_published_where_the_driver_cannot_see_it_is_not_counted(tiny_tree, tmp_path, monkeypatch):
    import fastload.pack.shard as shard

    elsewhere = tmp_path / "other-machine"
    real = shard.publish
    # as a task on another machine does with a local DST: its rename lands in that machine's folder
    monkeypatch.setattr(shard, "publish", lambda data, dst, name: real(data, str(elsewhere), name))
    dst = tmp_path / "dst"
    with pytest.raises(ConvertError, match=r"shard-00000-of-00002 was reported published, but this machine does "
                                           r"not see it \(missing\)"):
        convert_sharded(tiny_tree, dst, OPTS, EngineOptions(num_shards=2))
    assert not (dst / "manifest.json").exists()


def test_shard_size_units_and_default_are_stated_truly():
    from click.testing import CliRunner

    from fastload.cli import main
    from fastload.pack.engines import DEFAULT_SHARD_BYTES

    assert parse_size("64MB") == 64_000_000 and parse_size("64MiB") == parse_size("64Mi") == 2**26
    assert EngineOptions().shard_bytes == DEFAULT_SHARD_BYTES == parse_size("64MiB")
    text = " ".join(CliRunner().invoke(main, ["convert", "--help"]).output.split())
    assert "[default: 64MiB" in text and "64MB = 64,000,000 bytes" in text


def test_plan_and_manifest_are_fsynced_and_stale_tmp_removed(tiny_tree, tmp_path, monkeypatch):
    import os

    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / ".plan.json.tmp").write_text("{")  # a driver killed while writing its plan
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    convert_sharded(tiny_tree, dst, OPTS, EngineOptions(num_shards=2))
    for name in ("plan.json", "samples.json.gz", "manifest.json"):
        assert str(dst / f".{name}.tmp") in synced  # the file, before its rename
    assert synced.count(str(dst)) >= 5  # the folder after each rename: plan, 2 shards, samples, manifest
    # a driver killed mid-publish leaves a .shard-*.tmp folder: the next run removes it
    (dst / "manifest.json").unlink()
    (dst / ".shard-00001-of-00002.1234abcd.tmp").mkdir()
    (dst / ".shard-00001-of-00002.1234abcd.tmp" / "data.mdb").write_bytes(b"half")
    convert_sharded(tiny_tree, dst, OPTS, EngineOptions(num_shards=2))
    assert not [p.name for p in dst.iterdir() if p.name.startswith(".")]
