"""``fastload inspect``'s on-disk size and the smallest ``cache_limit`` for the default window (issue 34): the
records' size understates the shard files (LMDB's pages and free space), and a cache sized by it fails."""

from __future__ import annotations

import json

from click.testing import CliRunner

from fastload.cli import main
from fastload.load.shards import DEFAULT_WINDOW


def test_inspect_prints_the_files_on_disk_and_the_smallest_cache_limit(tiny_tree, tmp_path):
    dst = tmp_path / "sharded"
    r = CliRunner().invoke(main, ["convert", str(tiny_tree), str(dst), "-q", "--engine", "local", "--shard-size",
                                  "12KB", "--workers", "1", "--lossless"])
    assert r.exit_code == 0, r.output
    files = sorted(dst.glob("shard-*/data.mdb"))
    sizes = sorted((p.stat().st_size for p in files), reverse=True)
    assert len(sizes) > 2 * DEFAULT_WINDOW + 1
    info = json.loads(CliRunner().invoke(main, ["inspect", str(dst), "--json"]).output)
    assert info["disk_bytes"] == sum(sizes) > info["bytes"] and info["disk_files"] == len(files)
    assert info["min_cache_limit"] == sum(sizes[:2 * DEFAULT_WINDOW + 1])
    out = CliRunner().invoke(main, ["inspect", str(dst)]).output
    assert f"on disk   {sum(sizes) / 1e6:.1f} MB in {len(files)} LMDB files" in out
    assert f"cache_limit at least {info['min_cache_limit'] / 1e6:.1f} MB per rank" in out


def test_inspect_of_a_single_store_prints_its_file_without_a_cache_figure(tiny_store):
    info = json.loads(CliRunner().invoke(main, ["inspect", str(tiny_store), "--json"]).output)
    assert info["disk_bytes"] == (tiny_store / "data.mdb").stat().st_size and "min_cache_limit" not in info


def test_inspect_of_a_sharded_store_of_one_shard_still_prints_the_cache_figure(tiny_tree, tmp_path):
    """A sharded store of a single shard (a small dataset with --engine) printed no cache_limit figure."""
    dst = tmp_path / "one-shard"
    r = CliRunner().invoke(main, ["convert", str(tiny_tree), str(dst), "-q", "--engine", "local", "--num-shards", "1",
                                  "--workers", "1", "--lossless"])
    assert r.exit_code == 0, r.output
    (shard,) = dst.glob("shard-*/data.mdb")
    info = json.loads(CliRunner().invoke(main, ["inspect", str(dst), "--json"]).output)
    assert info["min_cache_limit"] == shard.stat().st_size and info["min_cache_shards"] == 1
