"""fastload.pack.convert: round trips, bad input, normalisation, resume, map growth, sharding."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lmdb
import numpy as np
import pytest
from PIL import Image, ImageOps
from torchvision.datasets import ImageFolder

from fastload.errors import ConvertError, IncompleteStoreError, SourceError
from fastload.load.dataset import LMDBImageDataset
from fastload.store import format as fmt
from fastload.pack.convert import ConvertOptions, convert
from fastload.image.policy import decode_rgb
from fastload.store.reader import load_store_metas
from helpers import bad_files, copy_tree, photo, plain_images, png_bytes, special_images

QUIET = dict(progress=False, workers=2)


def reference(path: Path) -> np.ndarray:
    """What a user sees: Pillow, EXIF orientation applied, RGB."""
    with Image.open(path) as img:
        return np.asarray(ImageOps.exif_transpose(img).convert("RGB"))


def all_records(path: Path) -> dict[bytes, bytes]:
    env = lmdb.open(str(path), readonly=True, lock=False)
    with env.begin() as txn:
        out = dict(txn.cursor())
    env.close()
    return out


def write_tree(root: Path, files: dict[str, bytes], cls: str = "a") -> Path:
    (root / cls).mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (root / cls / name).write_bytes(data)
    return root


def test_imagefolder_round_trip_matches_torchvision(tiny_tree, tiny_store):
    ds = LMDBImageDataset(tiny_store)
    tv = ImageFolder(str(tiny_tree))
    assert ds.classes == tv.classes
    assert ds.class_to_idx == tv.class_to_idx
    assert ds.targets == tv.targets
    assert list(ds.samples) == [(os.path.relpath(p, tiny_tree), t) for p, t in tv.samples]
    for i in range(len(ds)):
        img, label = ds[i]
        tv_img, tv_label = tv[i]
        assert label == tv_label
        assert img.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(img), np.asarray(tv_img))  # originals: pixel-equal
        assert ds.get_bytes(i) == (tiny_tree / ds.samples[i][0]).read_bytes()


def test_file_list_csv_with_class_names_and_header(tmp_path, tiny_tree):
    rows = ["path,label"]
    picked = sorted(tiny_tree.rglob("*.jpg"))[3:9]  # aurora and basalt
    for p in picked:
        rows.append(f"{os.path.relpath(p, tmp_path)},{'cat' if 'aurora' in p.name else 'dog'}")
    lst = tmp_path / "list.csv"
    lst.write_text("\n".join(rows) + "\n")
    convert(lst, tmp_path / "out", ConvertOptions(**QUIET))
    ds = LMDBImageDataset(tmp_path / "out")
    assert ds.classes == ["cat", "dog"]
    assert len(ds) == len(picked)
    for i, p in enumerate(picked):
        img, label = ds[i]
        assert label == ds.class_to_idx["cat" if "aurora" in p.name else "dog"]
        np.testing.assert_array_equal(np.asarray(img), reference(p))


def test_file_list_tsv_with_integer_labels(tmp_path, tiny_tree):
    picked = sorted(tiny_tree.rglob("*.png"))[:3]
    lst = tmp_path / "sub" / "list.tsv"
    lst.parent.mkdir()
    lst.write_text("".join(f"{p}\t{k * 2}\n" for k, p in enumerate(picked)))  # absolute paths
    convert(lst, tmp_path / "out", ConvertOptions(**QUIET))
    ds = LMDBImageDataset(tmp_path / "out")
    assert ds.classes == ["0", "1", "2", "3", "4"]
    assert ds.targets == [0, 2, 4]


def test_file_list_errors_name_the_line(tmp_path):
    lst = tmp_path / "l.csv"
    lst.write_text("a.jpg,1\nb.jpg\n")
    with pytest.raises(SourceError, match=r"l.csv:2: expected 2 fields"):
        convert(lst, tmp_path / "o", ConvertOptions(**QUIET))
    lst.write_text("a.jpg,-1\n")
    with pytest.raises(SourceError, match=r"l.csv:1: label -1 is negative"):
        convert(lst, tmp_path / "o", ConvertOptions(**QUIET))


def test_empty_tree_is_a_clear_error(tmp_path):
    (tmp_path / "src").mkdir()
    with pytest.raises(SourceError, match="no class folders"):
        convert(tmp_path / "src", tmp_path / "o", ConvertOptions(**QUIET))


@pytest.mark.parametrize("name", sorted(plain_images()))
def test_plain_images_are_stored_as_is(tmp_path, name):
    data = plain_images()[name]
    src = write_tree(tmp_path / "src", {name: data})
    report = convert(src, tmp_path / "out", ConvertOptions(lossless=name.endswith(".png"), **QUIET))
    ds = LMDBImageDataset(tmp_path / "out")
    assert report.canonicalised == {}
    assert ds.get_bytes(0) == data
    np.testing.assert_array_equal(np.asarray(ds[0][0]), reference(src / "a" / name))


@pytest.mark.parametrize("name", sorted(special_images()))
def test_special_images_are_canonicalised_to_what_a_user_sees(tmp_path, name):
    data = special_images()[name]
    src = write_tree(tmp_path / "src", {name: data, "plain.jpg": plain_images()["rgb.jpg"]})
    report = convert(src, tmp_path / "out", ConvertOptions(lossless=True, **QUIET))
    assert report.stored == 2 and not report.skipped
    assert sum(report.canonicalised.values()) == 1
    meta = load_store_metas(tmp_path / "out")[0]
    i = meta.paths.index(f"a/{name}")
    assert fmt.STORED_AS[meta.stored_as[i]] == "canonicalised"
    ds = LMDBImageDataset(tmp_path / "out")
    got = np.asarray(ds[i][0]).astype(int)
    want = decode_rgb(data).astype(int)
    assert got.shape == want.shape
    if name.endswith(".jpg"):  # lossy source, re-encoded at quality 95 (4:4:4)
        psnr = 10 * np.log10(255**2 / np.mean((got - want) ** 2))
        assert psnr > 34, psnr
    else:  # lossless re-encode
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["rgb.png", "gray.png", "palette.png", "rgba.png", "photo.webp", "photo.bmp"])
def test_non_jpeg_sources_are_stored_as_jpeg_q95_444_by_default(tmp_path, name):
    """Without --lossless every non-JPEG source loads as a JPEG: re-encoded at q95 4:4:4, its PSNR
    against the pixels a user sees recorded and reported; the JPEG beside it stays byte for byte."""
    data = {**plain_images(), **special_images()}[name]
    src = write_tree(tmp_path / "src", {name: data, "plain.jpg": plain_images()["rgb.jpg"]})
    report = convert(src, tmp_path / "out", ConvertOptions(**QUIET))
    meta = load_store_metas(tmp_path / "out")[0]
    i, j = meta.paths.index(f"a/{name}"), meta.paths.index("a/plain.jpg")
    ds = LMDBImageDataset(tmp_path / "out")
    assert fmt.STORED_AS[meta.stored_as[i]] == "reencoded" and fmt.ENCODINGS[meta.encoding[i]] == "jpeg"
    assert ds.get_bytes(j) == plain_images()["rgb.jpg"]
    assert report.reencoded == 1 and report.canonicalised == {}
    (reason,) = report.reencoded_reasons
    assert "JPEG q95 4:4:4" in reason and "--lossless" in reason
    got, want = np.asarray(ds[i][0]).astype(int), decode_rgb(data).astype(int)
    assert got.shape == want.shape
    psnr = 10 * np.log10(255**2 / max(np.mean((got - want) ** 2), 1e-9))
    assert report.lossy["count"] == 1 and abs(report.lossy["psnr_min"] - min(psnr, 100.0)) < 0.05
    assert psnr > 34, psnr


def test_lossless_refuses_lossy_options():
    with pytest.raises(ValueError, match="lossless cannot be combined"):
        ConvertOptions(lossless=True, max_side=256)
    with pytest.raises(ValueError, match="lossless cannot be combined"):
        ConvertOptions(lossless=True, quality=90)


def test_exif_orientation_is_applied(tmp_path):
    src = write_tree(tmp_path / "src", special_images())
    convert(src, tmp_path / "out", ConvertOptions(**QUIET))
    ds = LMDBImageDataset(tmp_path / "out")
    i = [p for p, _ in ds.samples].index("a/exif6.jpg")
    assert ds[i][0].size == (48, 80)  # 80x48 rotated by 90 degrees


def test_sixteen_bit_png_keeps_its_range(tmp_path):
    src = write_tree(tmp_path / "src", {"g.png": special_images()["gray16.png"]})
    convert(src, tmp_path / "out", ConvertOptions(lossless=True, **QUIET))
    img = np.asarray(LMDBImageDataset(tmp_path / "out")[0][0])
    want = np.asarray(photo(72, 56, seed=5).convert("L"))
    np.testing.assert_array_equal(img[..., 0], want)  # (v*257)>>8 == v, not clipped to 255


@pytest.mark.parametrize("name", sorted(bad_files()))
def test_bad_file_is_skipped_and_reported(tmp_path, tiny_tree, name):
    src = copy_tree(tiny_tree, tmp_path / "src")
    (src / "basalt" / name).write_bytes(bad_files()[name])
    good = len(ImageFolder(str(tiny_tree)))
    report = convert(src, tmp_path / "out", ConvertOptions(**QUIET))
    assert report.stored == good
    assert [s["relpath"] for s in report.skipped] == [f"basalt/{name}"]
    on_disk = json.loads((tmp_path / "out" / "report.json").read_text())
    assert on_disk["skipped"] == report.skipped
    assert "skipped 1" in report.summary_line()
    ds = LMDBImageDataset(tmp_path / "out")
    assert f"basalt/{name}" not in [p for p, _ in ds.samples]
    want = {"truncated.jpg": "truncated", "empty.jpg": "empty file", "notimage.jpg": "not an image",
            "bomb.png": "decompression bomb"}[name]
    assert want in report.skipped[0]["reason"]


def test_missing_file_in_list_is_skipped(tmp_path, tiny_tree):
    good = sorted(tiny_tree.rglob("*.jpg"))[0]
    lst = tmp_path / "l.csv"
    lst.write_text(f"{good},0\nnope.jpg,1\n")
    report = convert(lst, tmp_path / "out", ConvertOptions(**QUIET))
    assert report.stored == 1
    assert report.skipped == [{"relpath": "nope.jpg", "reason": "file not found"}]


def test_max_pixels_option_refuses_large_images(tmp_path, tiny_tree):
    report = convert(tiny_tree, tmp_path / "out", ConvertOptions(max_pixels=100 * 100, **QUIET))
    assert report.skipped and all("decompression bomb" in s["reason"] for s in report.skipped)
    assert report.stored + len(report.skipped) == report.total


def test_strict_stops_at_first_bad_file_and_keeps_committed(tmp_path, tiny_tree):
    src = copy_tree(tiny_tree, tmp_path / "src")
    (src / "coral" / "zz_bad.jpg").write_bytes(b"")
    opts = ConvertOptions(strict=True, chunk_size=2, **QUIET)
    with pytest.raises(ConvertError, match=r"zz_bad.jpg: empty file"):
        convert(src, tmp_path / "out", opts)
    with pytest.raises(IncompleteStoreError):
        LMDBImageDataset(tmp_path / "out")
    committed = sum(1 for k in all_records(tmp_path / "out") if len(k) == 8)
    assert committed == len(ImageFolder(str(tiny_tree))) - 0  # every good sample before the bad one
    (src / "coral" / "zz_bad.jpg").unlink()  # fix it, rerun the same command: it finishes
    report = convert(src, tmp_path / "out", opts)
    assert report.resumed_from == committed
    assert len(LMDBImageDataset(tmp_path / "out")) == committed


def test_crashing_decoder_loses_only_that_file(tmp_path, tiny_tree, monkeypatch):
    import fastload.pack.convert as conv

    src = copy_tree(tiny_tree, tmp_path / "src")
    (src / "aurora" / "crash_me.jpg").write_bytes(plain_images()["rgb.jpg"])
    monkeypatch.setattr(conv, "_HANDLER", "crashy_handler:prepare_item")
    report = convert(src, tmp_path / "out", ConvertOptions(**QUIET))
    assert report.stored == len(ImageFolder(str(tiny_tree)))
    assert len(report.skipped) == 1
    assert report.skipped[0]["relpath"] == "aurora/crash_me.jpg"
    assert "crashed the worker process" in report.skipped[0]["reason"]
    assert "SIGSEGV" in report.skipped[0]["reason"]


def test_rerun_on_complete_store_is_a_noop(tmp_path, tiny_tree):
    convert(tiny_tree, tmp_path / "out", ConvertOptions(**QUIET))
    before = all_records(tmp_path / "out")
    report = convert(tiny_tree, tmp_path / "out", ConvertOptions(**QUIET))
    assert report.already_complete
    assert "already complete" in report.summary_line()
    assert all_records(tmp_path / "out") == before


def test_different_source_or_options_on_existing_store_is_an_error(tmp_path, tiny_tree):
    other = copy_tree(tiny_tree, tmp_path / "other")
    convert(tiny_tree, tmp_path / "out", ConvertOptions(**QUIET))
    with pytest.raises(ConvertError, match="complete store of a different conversion"):
        convert(other, tmp_path / "out", ConvertOptions(**QUIET))
    with pytest.raises(ConvertError, match="option max_side"):
        convert(tiny_tree, tmp_path / "out", ConvertOptions(max_side=64, **QUIET))


def _partial_store(src: Path, dst: Path, n_chunks: int = 2) -> None:
    """Commit ``n_chunks`` chunks of a conversion, then stop as a crash would."""
    from fastload.store.writer import StoreWriter

    opts = ConvertOptions(chunk_size=3, **QUIET)
    real_commit = StoreWriter.commit
    calls = {"n": 0}

    def commit(self, puts, deletes=(), **kw):
        if any(k.startswith(fmt.CHUNK_PREFIX) for k, _ in puts):
            if calls["n"] == n_chunks:
                raise KeyboardInterrupt  # "crash" before the next chunk is committed
            calls["n"] += 1
        return real_commit(self, puts, deletes, **kw)

    StoreWriter.commit = commit
    try:
        with pytest.raises(KeyboardInterrupt):
            convert(src, dst, opts)
    finally:
        StoreWriter.commit = real_commit


def test_incomplete_store_refuses_other_source_and_options(tmp_path, tiny_tree):
    other = copy_tree(tiny_tree, tmp_path / "other")
    _partial_store(tiny_tree, tmp_path / "out")
    with pytest.raises(IncompleteStoreError, match="stopped after 6 samples"):
        LMDBImageDataset(tmp_path / "out")
    with pytest.raises(ConvertError, match="unfinished conversion with other inputs"):
        convert(other, tmp_path / "out", ConvertOptions(chunk_size=3, **QUIET))
    with pytest.raises(ConvertError, match="option shuffle"):
        convert(tiny_tree, tmp_path / "out", ConvertOptions(shuffle=True, chunk_size=3, **QUIET))


def test_incomplete_store_refuses_changed_packed_files(tmp_path, tiny_tree):
    src = copy_tree(tiny_tree, tmp_path / "src")
    _partial_store(src, tmp_path / "out")
    first = sorted((src / "aurora").iterdir())[0]
    first.write_bytes(plain_images()["rgb.jpg"])
    with pytest.raises(ConvertError, match="already packed .* were changed"):
        convert(src, tmp_path / "out", ConvertOptions(chunk_size=3, **QUIET))


def test_resume_after_interruption_gives_identical_records(tmp_path, tiny_tree):
    _partial_store(tiny_tree, tmp_path / "resumed")
    report = convert(tiny_tree, tmp_path / "resumed", ConvertOptions(chunk_size=5, **QUIET))
    assert report.resumed_from == 6
    convert(tiny_tree, tmp_path / "straight", ConvertOptions(**QUIET))
    assert all_records(tmp_path / "resumed") == all_records(tmp_path / "straight")


def test_map_grows_when_full(tmp_path, tiny_tree):
    report = convert(tiny_tree, tmp_path / "out", ConvertOptions(initial_map_size=32 * 1024, **QUIET))
    env = lmdb.open(str(tmp_path / "out"), readonly=True, lock=False)
    assert env.info()["map_size"] > 32 * 1024
    env.close()
    assert report.stored == len(ImageFolder(str(tiny_tree)))


def test_dst_that_is_not_a_store_is_refused(tmp_path, tiny_tree):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "thesis.tex").write_text("do not overwrite")
    with pytest.raises(ConvertError, match="not a fastload store"):
        convert(tiny_tree, tmp_path / "busy", ConvertOptions(**QUIET))
    assert (tmp_path / "busy" / "thesis.tex").read_text() == "do not overwrite"


def test_shuffle_is_seeded_and_labels_follow(tmp_path, tiny_tree):
    convert(tiny_tree, tmp_path / "s1", ConvertOptions(shuffle=True, seed=3, lossless=True, **QUIET))
    convert(tiny_tree, tmp_path / "s2", ConvertOptions(shuffle=True, seed=3, lossless=True, **QUIET))
    convert(tiny_tree, tmp_path / "s3", ConvertOptions(shuffle=True, seed=4, lossless=True, **QUIET))
    a, b, c = (LMDBImageDataset(tmp_path / n) for n in ("s1", "s2", "s3"))
    plain = ImageFolder(str(tiny_tree))
    assert list(a.samples) == list(b.samples)
    assert list(a.samples) != list(c.samples)
    assert list(a.samples) != [(os.path.relpath(p, tiny_tree), t) for p, t in plain.samples]
    assert sorted(a.samples) == sorted((os.path.relpath(p, tiny_tree), t) for p, t in plain.samples)
    for i in range(len(a)):
        rel, label = a.samples[i]
        assert a.targets[i] == label == plain.class_to_idx[rel.split("/")[0]]
        assert a.get_bytes(i) == (tiny_tree / rel).read_bytes()


def test_shards_open_as_one_dataset(tmp_path, tiny_tree):
    for i in range(3):
        convert(tiny_tree, tmp_path / "sharded", ConvertOptions(num_shards=3, shard_index=i, lossless=True, **QUIET))
    ds = LMDBImageDataset(tmp_path / "sharded")
    plain = ImageFolder(str(tiny_tree))
    assert len(ds) == len(plain)
    assert sorted(ds.samples) == sorted((os.path.relpath(p, tiny_tree), t) for p, t in plain.samples)
    for i in range(len(ds)):
        assert ds.get_bytes(i) == (tiny_tree / ds.samples[i][0]).read_bytes()


def test_missing_shard_is_reported(tmp_path, tiny_tree):
    for i in (0, 2):
        convert(tiny_tree, tmp_path / "sharded", ConvertOptions(num_shards=3, shard_index=i, **QUIET))
    with pytest.raises(IncompleteStoreError, match="shard-00001-of-00003"):
        LMDBImageDataset(tmp_path / "sharded")


def test_max_side_reencodes_large_images(tmp_path, tiny_tree):
    report = convert(tiny_tree, tmp_path / "out", ConvertOptions(max_side=100, quality=85, **QUIET))
    ds = LMDBImageDataset(tmp_path / "out")
    assert report.reencoded > 0
    meta = load_store_metas(tmp_path / "out")[0]
    for i in range(len(ds)):
        img = ds[i][0]
        with Image.open(tiny_tree / ds.samples[i][0]) as src:
            src_size = src.size
        assert max(img.size) <= 100
        if max(src_size) > 100:
            assert fmt.STORED_AS[meta.stored_as[i]] == "reencoded"
            assert ds.get_bytes(i)[:3] == b"\xff\xd8\xff"
            assert abs(img.size[0] / img.size[1] - src_size[0] / src_size[1]) < 0.05
        elif ds.samples[i][0].endswith(".png"):  # small, but not a JPEG: JPEG q95 4:4:4 (not lossless)
            assert fmt.STORED_AS[meta.stored_as[i]] == "reencoded" and ds.get_bytes(i)[:3] == b"\xff\xd8\xff"
        else:
            assert ds.get_bytes(i) == (tiny_tree / ds.samples[i][0]).read_bytes()


def test_disk_full_gives_clear_error_and_store_resumes(tmp_path, tiny_tree):
    """A real write failure: RLIMIT_FSIZE makes the LMDB file unable to grow (EFBIG)."""
    script = textwrap.dedent(f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, 150_000))
        from fastload.cli import main
        sys.argv = ["fastload", "convert", {str(tiny_tree)!r}, {str(tmp_path / 'out')!r},
                    "--quiet", "--chunk-size", "2", "--workers", "1"]
        main()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "writing failed after" in proc.stderr
    assert "HINT: the disk (or a file-size limit) is full" in proc.stderr
    report = convert(tiny_tree, tmp_path / "out", ConvertOptions(**QUIET))
    assert report.resumed_from > 0
    convert(tiny_tree, tmp_path / "straight", ConvertOptions(**QUIET))
    assert all_records(tmp_path / "out") == all_records(tmp_path / "straight")


def test_decoders_agree_on_every_stored_sample(tmp_path, tiny_store):
    """Pillow, simplejpeg and torchvision.io give the same pixels for what the store holds."""
    import simplejpeg
    import torch
    from torchvision.io import ImageReadMode, decode_image

    ds = LMDBImageDataset(tiny_store)
    for i in range(len(ds)):
        data = ds.get_bytes(i)
        pil = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        tv = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        np.testing.assert_array_equal(tv.permute(1, 2, 0).numpy(), pil)
        if data[:2] == b"\xff\xd8":
            np.testing.assert_array_equal(simplejpeg.decode_jpeg(data), pil)


@pytest.mark.parametrize("mode", ["RGB", "P"])
def test_non_jpeg_sources_wider_than_jpeg_allows_stay_lossless(tmp_path, mode):
    """JPEG cannot hold more than 65500 px a side: such a PNG is kept (as-is, or as lossless PNG), never lost."""
    img = Image.fromarray(np.random.default_rng(1).integers(0, 255, (2, 65600, 3), dtype=np.uint8))
    data = png_bytes(img.convert(mode) if mode == "P" else img)
    src = write_tree(tmp_path / "src", {"wide.png": data})
    for opts in (ConvertOptions(**QUIET), ConvertOptions(quality=80, **QUIET)):
        dst = tmp_path / f"out{opts.quality}"
        report = convert(src, dst, opts)
        assert report.stored == 1 and not report.skipped, report.skipped
        ds = LMDBImageDataset(dst)
        assert ds.get_bytes(0)[:4] == b"\x89PNG"
        np.testing.assert_array_equal(np.asarray(ds[0][0]), decode_rgb(data))


def test_psnr_matches_the_float_formula_and_is_exact_for_equal_images():
    from fastload.image.policy import PSNR_EXACT, psnr

    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (333, 517, 3), dtype=np.uint8)
    b = np.clip(a.astype(int) + rng.integers(-9, 10, a.shape), 0, 255).astype(np.uint8)
    want = 10 * np.log10(255**2 / np.mean((a.astype(np.float64) - b) ** 2))
    assert psnr(a, b) == pytest.approx(want, abs=0.01)
    assert psnr(a, a) == PSNR_EXACT


def test_source_read_error_stops_the_run_and_a_rerun_reads_the_file(tmp_path, tiny_tree, monkeypatch):
    import fastload.pack.convert as conv
    from fastload.errors import SourceReadError

    src = copy_tree(tiny_tree, tmp_path / "src")
    (src / "aurora" / "flaky_read.jpg").write_bytes(plain_images()["rgb.jpg"])
    fault = tmp_path / "fault"
    fault.touch()
    monkeypatch.setenv("FASTLOAD_TEST_FAULT", str(fault))
    monkeypatch.setattr(conv, "_HANDLER", "flaky_read_handler:prepare_item")
    with pytest.raises(SourceReadError, match=r"flaky_read.jpg: reading it failed"):
        convert(src, tmp_path / "out", ConvertOptions(**QUIET))
    with pytest.raises(IncompleteStoreError):
        LMDBImageDataset(tmp_path / "out")
    fault.unlink()
    report = convert(src, tmp_path / "out", ConvertOptions(**QUIET))
    assert report.skipped == [] and report.stored == len(ImageFolder(str(tiny_tree))) + 1
