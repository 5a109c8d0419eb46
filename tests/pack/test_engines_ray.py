"""The ray engine on a real local cluster (tests/cluster.py): the same bytes as the local engine,
also when a shard task is killed mid-shard and retried, and to and from S3 (tests/s3.py)."""

from __future__ import annotations

import dataclasses
import re
import shutil
import time
from pathlib import Path

import pytest

from fastload.pack.convert import ConvertOptions
from fastload.pack.engines import EngineOptions, convert_sharded
from fastload.store import remote
from fastload.store.reader import StoreReader

OPTS = ConvertOptions(progress=False, lossless=True, workers=1)
pytestmark = pytest.mark.slow


def _files(dst: Path) -> dict[str, bytes]:
    return {str(p.relative_to(dst)): p.read_bytes() for p in sorted(dst.rglob("*")) if p.is_file()}


def test_ray_equals_local(ray_cluster, tiny_tree, tmp_path):
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    convert_sharded(tiny_tree, local, OPTS, EngineOptions(num_shards=3))
    report = convert_sharded(tiny_tree, on_ray, OPTS, EngineOptions(engine="ray", num_shards=3))
    assert report.stored == 24
    assert _files(local) == _files(on_ray)
    assert len(StoreReader(on_ray)) == 24


def test_task_killed_mid_shard_is_retried_and_store_identical(ray_cluster, tiny_tree, tmp_path, capsys):
    tree = tmp_path / "tree"
    shutil.copytree(tiny_tree, tree)
    files = sorted((tree / sorted(p.name for p in tree.iterdir() if p.is_dir())[1]).iterdir())
    victim = files[3].with_name(files[3].stem + "~die_once.jpg")  # sorts between files[3] and files[4]
    shutil.copyfile(files[0], victim)  # 25 files, shards of 8/8/9: the 5th file of shard 1, mid-shard
    opts = ConvertOptions(progress=False, lossless=True, workers=1, chunk_size=2)  # 2 chunks committed by then
    ref = tmp_path / "ref"
    convert_sharded(tree, ref, opts, EngineOptions(num_shards=3))
    dst, scratch = tmp_path / "dst", tmp_path / "scratch"
    scratch.mkdir()
    capsys.readouterr()
    report = convert_sharded(tree, dst, dataclasses.replace(opts, progress=True),
                             EngineOptions(engine="ray", num_shards=3, max_retries=2, scratch=str(scratch)),
                             handler="die_once_handler:prepare_item")
    counts = re.findall(r"(\d+)/25 ", capsys.readouterr().err)
    assert counts and counts[-1] == "25" and max(map(int, counts)) <= 25  # the killed attempt's files taken back
    marker = victim.with_name(victim.name + ".killed")
    assert marker.exists()  # the task really died once
    assert int(marker.read_text()) >= 4  # ... with a half-written shard in scratch (samples committed)
    assert report.stored == 25
    assert _files(dst) == _files(ref)
    assert not [p for p in dst.iterdir() if p.name.startswith(".")]  # no half shard left behind
    convert_sharded(tree, tmp_path / "again", opts, EngineOptions(num_shards=3, scratch=str(scratch)))
    assert list(scratch.iterdir()) == []  # the killed attempt's scratch was removed by the next shard


def test_ray_folder_to_s3_and_back(ray_cluster, s3_server, fresh_bucket, tiny_tree, tmp_path):
    local = tmp_path / "local"
    convert_sharded(tiny_tree, local, OPTS, EngineOptions(num_shards=2))
    url = f"s3://{fresh_bucket}/store"
    convert_sharded(tiny_tree, url, OPTS, EngineOptions(engine="ray", num_shards=2))
    for rel, data in _files(local).items():
        assert remote.get_bytes(f"{url}/{rel}") == data, rel


def test_cli_engine_ray_prints_the_local_summary(ray_cluster, tiny_tree, tmp_path):
    from click.testing import CliRunner

    from fastload.cli import main

    tree = tmp_path / "tree"
    shutil.copytree(tiny_tree, tree)
    (tree / sorted(p.name for p in tree.iterdir() if p.is_dir())[0] / "broken.jpg").write_bytes(b"\xff\xd8 nope")
    args = ["convert", str(tree), str(tmp_path / "dst"), "--engine", "ray", "--num-shards", "3", "--lossless",
            "-q"]
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "stored 24 of 25 images, skipped 1" in r.output and "broken.jpg" in r.output
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert "already complete" in r.output


def test_cli_joins_a_running_cluster_with_address(ray_cluster, tiny_tree, tmp_path):
    import os
    import subprocess
    import sys

    root = str(Path(__file__).parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "fastload.cli", "convert", str(tiny_tree), str(tmp_path / "dst"),
                          "--engine", "ray", "--address", ray_cluster, "--shared-fs", "--num-shards", "2", "--lossless",
                          "-q"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "stored 24 of 24 images" in out.stdout
    local = tmp_path / "local"
    convert_sharded(tiny_tree, local, OPTS, EngineOptions(num_shards=2))
    assert _files(local) == _files(tmp_path / "dst")


def test_a_failed_shard_cancels_the_others(ray_cluster, tiny_tree, tmp_path):
    from fastload.errors import ConvertError

    tree = tmp_path / "tree"
    shutil.copytree(tiny_tree, tree)
    first = sorted(p.name for p in tree.iterdir() if p.is_dir())[0]
    shutil.copyfile(next((tree / first).glob("*.jpg")), tree / first / "0_fail_now.jpg")  # 1st file of shard 0
    dst = tmp_path / "dst"
    with pytest.raises(ConvertError, match="0_fail_now.jpg: reading it failed"):
        convert_sharded(tree, dst, OPTS, EngineOptions(engine="ray", num_shards=3, max_retries=0),
                        handler="fail_or_slow_handler:prepare_item")
    time.sleep(12)  # the other shards needed ~8 s more (a second a file): cancelled, they publish nothing
    assert not [p.name for p in dst.iterdir() if p.name.startswith("shard-")]
