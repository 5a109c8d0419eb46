"""The compiled region decoder (fastload/image/_jpeg.c): a full decode's pixels, cropped, or a clear refusal."""

from __future__ import annotations

import importlib.util
import io
import math

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from helpers import jpeg_bytes, photo

pytestmark = pytest.mark.skipif(importlib.util.find_spec("fastload.image._jpeg") is None,
                                reason="fastload was installed without its compiled region decoder "
                                       "(needs a C compiler and libjpeg headers: apt-get install gcc libjpeg-dev)")

# sizes that are not whole MCUs, and the crops a random-resized crop makes: at the edges, one pixel, the whole image
SIZES = [(333, 250), (97, 161), (640, 427)]
ENCODINGS = {
    "4:2:0": {"subsampling": 2},
    "4:2:2": {"subsampling": 1},
    "4:4:4": {"subsampling": 0},
    "progressive 4:2:0": {"subsampling": 2, "progressive": True},
    "restart markers 4:2:0": {"subsampling": 2, "restart_marker_blocks": 3},
}


def boxes(h: int, w: int) -> list[tuple[int, int, int, int]]:
    rng = np.random.default_rng(h * w)
    out = [(0, 0, h, w), (h - 1, w - 1, 1, 1), (0, w - 17, h, 17), (h // 3, 0, h // 3, w), (5, 3, 1, w - 3)]
    for _ in range(20):
        ch, cw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
        out.append((int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw))
    return out


def region(data: bytes, top: int, left: int, h: int, w: int, scale: int = 1, max_pixels: int = 10**9) -> np.ndarray:
    from fastload.image import _jpeg

    out = np.empty((h, w, 3), np.uint8)
    _jpeg.decode_region(data, top, left, h, w, scale, max_pixels, out)
    return out


@pytest.mark.parametrize("encoding", list(ENCODINGS))
@pytest.mark.parametrize("wh", SIZES)
def test_a_region_is_pillows_full_decode_cropped(encoding, wh):
    # Pillow's decode is the pixel contract (policy.decode_reference); the crop's edge columns are the test:
    # libjpeg-turbo upsamples the chroma at a crop's edge as at the image's, unless the crop is made wider
    data = jpeg_bytes(photo(*wh, seed=sum(wh)), **ENCODINGS[encoding])
    full = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    for top, left, h, w in boxes(*full.shape[:2]):
        np.testing.assert_array_equal(region(data, top, left, h, w), full[top:top + h, left:left + w],
                                      err_msg=f"{encoding} {wh}: region ({top}, {left}) {h} x {w}")


def test_a_grayscale_jpeg_comes_out_rgb():
    data = jpeg_bytes(photo(120, 90, seed=4).convert("L"))
    full = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    np.testing.assert_array_equal(region(data, 10, 7, 50, 61), full[10:60, 7:68])


@pytest.mark.parametrize("scale", [2, 4, 8])
def test_a_region_at_a_dct_scale_is_simplejpegs_scaled_decode_cropped(scale):
    for kind in ({"subsampling": 0}, {"subsampling": 2}, {"subsampling": 2, "progressive": True}):
        data = jpeg_bytes(photo(1001, 750, seed=scale), **kind)
        full = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=math.ceil(750 / scale),
                                      min_width=math.ceil(1001 / scale), min_factor=scale)
        assert full.shape[:2] == (math.ceil(750 / scale), math.ceil(1001 / scale))
        for top, left, h, w in boxes(*full.shape[:2]):
            np.testing.assert_array_equal(region(data, top, left, h, w, scale), full[top:top + h, left:left + w],
                                          err_msg=f"1/{scale}, {kind}: ({top}, {left}) {h} x {w}")


def test_the_preset_decodes_the_same_crops_with_and_without_it(monkeypatch):
    import torch

    import fastload.image.fast as fast
    from fastload.load.transforms import train_transform

    # both branches of the preset: a region at full scale (small images) and a region of a DCT-scaled image
    blobs = [jpeg_bytes(photo(w, h, seed=w), subsampling=2) for w, h in [(300, 200), (1200, 900), (2000, 1500)]]
    tf = train_transform(224)
    draws = [tf.draw(b, torch.Generator().manual_seed(k)) for k in range(8) for b in blobs]
    with_it = [tf.decode_crop(b, d) for d, b in zip(draws, blobs * 8)]
    assert fast.jpeg_backend() == "libjpeg-turbo"
    monkeypatch.setattr(fast, "_TURBO", None)
    assert fast.jpeg_backend() != "libjpeg-turbo"
    without = [tf.decode_crop(b, d) for d, b in zip(draws, blobs * 8)]
    assert [torch.equal(a, b) for a, b in zip(with_it, without)] == [True] * len(draws)


def test_the_fast_path_gives_it_the_bomb_limit(monkeypatch):
    import fastload.image.fast as fast

    data = jpeg_bytes(photo(64, 48, seed=1))
    monkeypatch.setattr(fast, "DEFAULT_MAX_PIXELS", 64 * 48 - 1)
    assert fast._turbo_region(data, 0, 0, 8, 8, 1) is None  # refused from the header; the fallback's check names it
    monkeypatch.setattr(fast, "DEFAULT_MAX_PIXELS", 64 * 48)
    assert fast._turbo_region(data, 0, 0, 8, 8, 1).shape == (8, 8, 3)


def test_what_it_refuses_is_decoded_as_before_and_named():
    import fastload.image.fast as fast
    from fastload.image import _jpeg
    from fastload.image.policy import BadImage

    data = jpeg_bytes(photo(64, 48, seed=1))
    with pytest.raises(ValueError, match="end-of-image"):  # cut short: libjpeg would fill the rest with grey
        region(data[: len(data) // 2], 0, 0, 48, 64)
    with pytest.raises(ValueError, match="end-of-image"):  # even where the crop ends above the cut
        region(data[: len(data) - 40], 0, 0, 8, 8)
    with pytest.raises(BadImage):  # and the fast path names it, as before
        fast.decode_rgb_region(data[: len(data) // 2], 0, 0, 32, 32)
    with pytest.raises(ValueError, match="over the limit"):  # a decompression bomb: refused from its header
        region(data, 0, 0, 8, 8, max_pixels=64 * 48 - 1)
    region(data, 0, 0, 8, 8, max_pixels=64 * 48)
    cmyk = io.BytesIO()
    photo(64, 48, seed=2).convert("CMYK").save(cmyk, "JPEG", quality=90)
    with pytest.raises(ValueError, match="libjpeg"):  # no CMYK to RGB in libjpeg: Pillow's conversion instead
        region(cmyk.getvalue(), 0, 0, 48, 64)
    want = np.asarray(Image.open(io.BytesIO(cmyk.getvalue())).convert("RGB"))
    np.testing.assert_array_equal(fast.decode_rgb_region(cmyk.getvalue(), 4, 5, 20, 30), want[4:24, 5:35])
    with pytest.raises(ValueError, match="outside"):
        region(data, 40, 0, 9, 64)
    with pytest.raises(ValueError, match="scale"):
        region(data, 0, 0, 8, 8, scale=3)
    with pytest.raises(ValueError, match="contiguous"):
        _jpeg.decode_region(data, 0, 0, 8, 8, 1, 10**9, np.empty((8, 9, 3), np.uint8))
