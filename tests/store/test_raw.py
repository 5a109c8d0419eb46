"""Raw stores (``--encoding raw|auto``): pixel-exact round trips, and every reader handles them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from fastload.cli import main
from fastload.image.fast import decode_rgb_fast, decode_rgb_region, image_size
from fastload.image.policy import AUTO_RAW_MAX_PIXELS, decode_rgb
from fastload.load.dataset import LMDBImageDataset
from fastload.load.transforms import eval_transform, train_transform
from fastload.pack.convert import ConvertOptions, convert
from fastload.store import format as fmt
from helpers import jpeg_bytes, photo

QUIET = dict(progress=False, workers=2)


@pytest.fixture(scope="module")
def raw_store(tiny_tree, tmp_path_factory):
    dst = tmp_path_factory.mktemp("raw") / "raw.lmdb"
    convert(tiny_tree, dst, ConvertOptions(encoding="raw", **QUIET))
    return dst


def test_raw_round_trip_is_pixel_exact(raw_store, tiny_store):
    raw, enc = LMDBImageDataset(raw_store), LMDBImageDataset(tiny_store)
    assert len(raw) == len(enc) and raw.targets == enc.targets
    codes = raw._reader.encoding
    assert set(codes.tolist()) == {fmt.ENCODINGS.index("raw")}
    for i in range(len(raw)):
        want = decode_rgb(enc.get_bytes(i))
        data = raw.get_bytes(i)
        np.testing.assert_array_equal(decode_rgb_fast(data), want)
        np.testing.assert_array_equal(np.asarray(raw[i][0]), want)  # Pillow reads the PPM too
        assert image_size(data) == want.shape[:2]
        np.testing.assert_array_equal(decode_rgb_region(data, 3, 5, 10, 12), want[3:13, 5:17])
        h, w = want.shape[:2]
        whole = decode_rgb_region(data, 0, 0, h, w)  # a crop of the whole image (RRC's fallback)
        assert whole.flags.writeable and decode_rgb_fast(data).flags.writeable  # torch warns on read-only arrays
        np.testing.assert_array_equal(whole, want)


def test_presets_on_raw_records_match_the_same_crop_of_the_pixels(raw_store):
    ds = LMDBImageDataset(raw_store)
    tf = train_transform(32)
    for i in range(0, len(ds), 5):
        torch.manual_seed(i)
        a = tf.from_bytes(ds.get_bytes(i))
        torch.manual_seed(i)
        b = tf(ds[i][0])
        assert torch.equal(a, b)
    ev = eval_transform(32, 40)
    assert torch.equal(ev.from_bytes(ds.get_bytes(0)), ev(ds[0][0]))


def test_auto_stores_small_images_raw_and_large_ones_encoded(tmp_path):
    tree = tmp_path / "t"
    (tree / "a").mkdir(parents=True)
    (tree / "a" / "small.jpg").write_bytes(jpeg_bytes(photo(200, 150, seed=1)))
    (tree / "a" / "large.jpg").write_bytes(jpeg_bytes(photo(400, 300, seed=2)))
    assert 200 * 150 <= AUTO_RAW_MAX_PIXELS < 400 * 300
    convert(tree, tmp_path / "auto", ConvertOptions(encoding="auto", **QUIET))
    ds = LMDBImageDataset(tmp_path / "auto")
    enc = {rel: fmt.ENCODINGS[c] for (rel, _), c in zip(ds.samples, ds._reader.encoding)}
    assert enc == {"a/large.jpg": "jpeg", "a/small.jpg": "raw"}
    convert(tree, tmp_path / "auto-small", ConvertOptions(encoding="auto", max_side=160, **QUIET))
    ds = LMDBImageDataset(tmp_path / "auto-small")
    assert set(ds._reader.encoding.tolist()) == {fmt.ENCODINGS.index("raw")}
    assert max(decode_rgb_fast(ds.get_bytes(i)).shape[:2] == (120, 160) for i in range(2))


def test_inspect_and_verify_handle_raw_records(raw_store):
    info = json.loads(CliRunner().invoke(main, ["inspect", str(raw_store), "--json"]).output)
    assert info["encodings"]["raw"] == info["count"] == 24 and info["bytes_per_image"] > 3 * 48 * 48
    r = CliRunner().invoke(main, ["verify", str(raw_store), "--quiet", "--decoders", "fastload,pil,torchvision"])
    assert r.exit_code == 0, r.output


def test_thread_pipeline_reads_raw_records(raw_store):
    from fastload.load.loader import DataLoader
    from fastload.load.transforms import collate_uint8

    ds = LMDBImageDataset(raw_store, transform=train_transform(32))
    batches = list(DataLoader(ds, batch_size=8, num_workers=2, backend="threads", collate_fn=collate_uint8))
    assert [b[0].shape for b in batches] == [(8, 3, 32, 32)] * 3


@pytest.mark.dali
@pytest.mark.parametrize("train", [True, False])
def test_dali_reads_raw_records(raw_store, train):
    from fastload.dali import DALILoader

    seen = []
    for images, _labels, index in DALILoader(raw_store, 8, train=train, size=32, device="cpu", num_threads=1,
                                             return_index=True):
        assert images.shape[1:] == (3, 32, 32) and images.dtype == torch.float32
        seen += index.tolist()
    assert sorted(seen) == list(range(24))


@pytest.mark.dali
def test_dali_decoder_agrees_on_raw_records(raw_store):
    r = CliRunner().invoke(main, ["verify", str(raw_store), "--quiet", "--decoders", "dali"])
    assert r.exit_code == 0, r.output
