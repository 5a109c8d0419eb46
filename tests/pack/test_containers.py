"""WebDataset tar shards and Hugging Face-layout Parquet files as convert sources, local and on S3."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from fastload.errors import SourceError
from fastload.pack.containers import container_source
from fastload.pack.convert import ConvertOptions
from fastload.pack.engines import EngineOptions, convert_sharded
from fastload.store import remote
from fastload.store.reader import StoreReader

OPTS = ConvertOptions(progress=False, lossless=True, workers=1)


def _samples(tree: Path) -> list[tuple[Path, int]]:
    classes = sorted(p.name for p in tree.iterdir() if p.is_dir())
    return [(f, i) for i, c in enumerate(classes) for f in sorted((tree / c).iterdir())]


def _make_tars(tree: Path, out: Path, per_tar: int = 10) -> list[tuple[bytes, int]]:
    out.mkdir()
    samples = _samples(tree)
    for t in range(0, len(samples), per_tar):
        with tarfile.open(out / f"shard-{t // per_tar:04d}.tar", "w") as tf:
            for k, (f, label) in enumerate(samples[t:t + per_tar]):
                key = f"s{t + k:05d}"
                for name, data in ((f"{key}{f.suffix.lower()}", f.read_bytes()), (f"{key}.cls", str(label).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    return [(f.read_bytes(), label) for f, label in samples]


def _make_parquet(tree: Path, out: Path) -> list[tuple[bytes, int]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir()
    samples = _samples(tree)
    classes = sorted(p.name for p in tree.iterdir() if p.is_dir())
    features = {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": classes}}
    for part, rows in enumerate((samples[:15], samples[15:])):
        table = pa.table({"image": [{"bytes": f.read_bytes(), "path": f.name} for f, _ in rows],
                          "label": pa.array([label for _, label in rows], pa.int64())})
        table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
        pq.write_table(table, out / f"train-{part:05d}-of-00002.parquet", row_group_size=4)
    return [(f.read_bytes(), label) for f, label in samples]


def _check(dst: Path, expected: list[tuple[bytes, int]]) -> None:
    reader = StoreReader(dst)
    assert [(reader.get(i), int(reader.labels[i])) for i in range(len(reader))] == expected


def test_webdataset_tars(tiny_tree, tmp_path):
    expected = _make_tars(tiny_tree, tmp_path / "wds")
    src = container_source(tmp_path / "wds")
    assert src.kind == "webdataset" and src.classes == ["0", "1", "2"] and len(src) == 24
    convert_sharded(tmp_path / "wds", tmp_path / "dst", OPTS, EngineOptions(num_shards=2))
    _check(tmp_path / "dst", expected)


def test_parquet_hf_layout(tiny_tree, tmp_path):
    expected = _make_parquet(tiny_tree, tmp_path / "pq")
    src = container_source(tmp_path / "pq")
    assert src.kind == "parquet" and src.classes == sorted(p.name for p in tiny_tree.iterdir() if p.is_dir())
    convert_sharded(tmp_path / "pq", tmp_path / "dst", OPTS, EngineOptions(num_shards=3))
    _check(tmp_path / "dst", expected)
    assert StoreReader(tmp_path / "dst").classes == src.classes


def test_tar_without_labels_is_named(tmp_path):
    (tmp_path / "wds").mkdir()
    with tarfile.open(tmp_path / "wds" / "a.tar", "w") as tf:
        info = tarfile.TarInfo("k1.jpg")
        info.size = 3
        tf.addfile(info, io.BytesIO(b"abc"))
    with pytest.raises(SourceError, match="k1.jpg has no k1.cls label member"):
        container_source(tmp_path / "wds")


def _tar_with_labels(out: Path, labels: list[int]) -> Path:
    from helpers import jpeg_bytes, photo

    out.mkdir()
    with tarfile.open(out / "a.tar", "w") as tf:
        for k, label in enumerate(labels):
            for name, data in ((f"k{k}.jpg", jpeg_bytes(photo(16, 16, seed=k))), (f"k{k}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return out


def _parquet_with_labels(out: Path, labels: list[int], names: list[str] | None) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir()
    table = pa.table({"image": [{"bytes": b"x", "path": f"{k}.jpg"} for k in range(len(labels))],
                      "label": pa.array(labels, pa.int64())})
    if names:
        features = {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": names}}
        table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    pq.write_table(table, out / "train.parquet")
    return out


# 2,000,000,000 made a list of 2e9 class names (MemoryError); 5000 made 5001 classes for 3 labels
@pytest.mark.parametrize("huge", [5000, 2_000_000_000])
def test_a_webdataset_label_far_outside_the_labels_seen_is_named(tmp_path, huge):
    src = _tar_with_labels(tmp_path / "wds", [0, 1, huge, 1])
    with pytest.raises(SourceError, match=rf"a.tar: member k2.cls holds label {huge}, outside 0..2 "
                                          r"\(3 distinct labels\)") as exc:
        container_source(src)
    assert "--num-classes" in str(exc.value)
    if huge == 5000:  # a dataset that really has that many classes says so
        assert len(container_source(src, num_classes=5001).classes) == 5001
        with pytest.raises(SourceError, match=r"k2.cls holds label 5000, outside 0..4999 \(--num-classes 5000\)"):
            container_source(src, num_classes=5000)


@pytest.mark.parametrize("names", [None, ["cat", "dog"]])
@pytest.mark.parametrize("huge", [5000, 2_000_000_000])
def test_a_parquet_label_far_outside_the_labels_seen_is_named(tmp_path, huge, names):
    src = _parquet_with_labels(tmp_path / "pq", [0, 1, 1, huge], names)
    with pytest.raises(SourceError, match=rf"train.parquet: row 3 \('label' column\) holds label {huge}, outside"):
        container_source(src)


def test_cli_refuses_a_huge_label_with_its_member(tmp_path):
    from click.testing import CliRunner

    from fastload.cli import main

    src = _tar_with_labels(tmp_path / "wds", [0, 2_000_000_000])
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "dst"), "-q"], catch_exceptions=False)
    assert r.exit_code == 1 and "k1.cls holds label 2000000000" in r.output, r.output
    assert not (tmp_path / "dst").exists()


def test_tar_and_parquet_on_s3(s3_server, fresh_bucket, tiny_tree, tmp_path):
    expected = _make_tars(tiny_tree, tmp_path / "wds")
    _make_parquet(tiny_tree, tmp_path / "pq")
    for folder in ("wds", "pq"):
        for f in sorted((tmp_path / folder).iterdir()):
            remote.upload_file(f, f"s3://{fresh_bucket}/{folder}/{f.name}")
    convert_sharded(f"s3://{fresh_bucket}/wds/", tmp_path / "from-wds", OPTS, EngineOptions(num_shards=2))
    convert_sharded(f"s3://{fresh_bucket}/pq", tmp_path / "from-pq", OPTS, EngineOptions(num_shards=2))
    _check(tmp_path / "from-wds", expected)
    _check(tmp_path / "from-pq", expected)


def test_listing_remote_containers_reads_headers_not_images(s3_server, fresh_bucket, tmp_path, monkeypatch):
    import numpy as np
    import obstore
    from PIL import Image

    tree = tmp_path / "tree"
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (tree / c).mkdir(parents=True)
        for k in range(4):  # noise: ~120 KB a PNG, so image bytes dwarf headers, footers and labels
            Image.fromarray(rng.integers(0, 256, (200, 200, 3), dtype=np.uint8)).save(tree / c / f"{k}.png")
    _make_tars(tree, tmp_path / "wds", per_tar=4)
    _make_parquet(tree, tmp_path / "pq")
    total = {}
    for folder in ("wds", "pq"):
        for f in sorted((tmp_path / folder).iterdir()):
            remote.upload_file(f, f"s3://{fresh_bucket}/{folder}/{f.name}")
        total[folder] = sum(f.stat().st_size for f in (tmp_path / folder).iterdir())
    fetched, listed = [], []
    real_range, real_reader, real_list = remote.get_range, remote.open_reader, obstore.list

    def get_range(url, start, length):
        data = real_range(url, start, length)
        fetched.append(len(data))
        return data

    def open_reader(url):  # obstore's reader fetches 4 MB buffers: its first fetch, at least
        fetched.append(min(4 << 20, remote.head(url)))
        return real_reader(url)

    monkeypatch.setattr(remote, "get_range", get_range)
    monkeypatch.setattr(remote, "open_reader", open_reader)
    monkeypatch.setattr(obstore, "list", lambda *a, **k: listed.append(k.get("prefix")) or real_list(*a, **k))
    from fastload.pack.containers import open_any_source

    for folder in ("wds", "pq"):
        fetched.clear()
        listed.clear()
        src = open_any_source(f"s3://{fresh_bucket}/{folder}")
        assert len(src) == 8 and src.kind == {"wds": "webdataset", "pq": "parquet"}[folder]
        assert sum(fetched) < total[folder] / 8, (folder, sum(fetched), total[folder])
        assert listed == [f"{folder}"], listed  # the prefix is listed once
