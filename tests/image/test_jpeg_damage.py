"""Bit rot in a JPEG's scan data is skipped, header oddities are not (docs/jpeg-damage.md)."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from fastload.datasets import DatasetSpec, render_image
from fastload.image.policy import BadImage, decode_rgb, prepare


def _photo_jpeg(index: int = 0, **kw) -> bytes:
    buf = io.BytesIO()
    render_image(DatasetSpec(min_side=96, max_side=200), index % 10, index).save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def _segment_end(data: bytes, marker: bytes) -> int:
    i = data.index(marker)
    return i + 2 + struct.unpack(">H", data[i + 2:i + 4])[0]


def _rotted(data: bytes, seed: int) -> bytes:
    """1..6 bytes of the scan data changed (seeded), as bit rot would."""
    rng = np.random.default_rng(seed)
    start, end = _segment_end(data, b"\xff\xda"), data.rindex(b"\xff\xd9")
    b = bytearray(data)
    for pos in rng.choice(np.arange(start, end), size=int(rng.integers(1, 7)), replace=False):
        b[int(pos)] ^= int(rng.integers(1, 256))
    return bytes(b)


def _libjpeg_warns(data: bytes) -> str | None:
    try:
        simplejpeg.decode_jpeg(data, strict=True)
    except ValueError as exc:
        return str(exc)
    return None


def _icc_app2(seq: int, count: int) -> bytes:
    body = b"ICC_PROFILE\0" + bytes([seq, count]) + b"\0" * 128
    return b"\xff\xe2" + struct.pack(">H", len(body) + 2) + body


@pytest.mark.parametrize("progressive", [False, True], ids=["baseline", "progressive"])
def test_prepare_refuses_rotted_photos_that_libjpeg_warns_about(progressive):
    warned = 0
    for seed in range(24):
        bad = _rotted(_photo_jpeg(seed, progressive=progressive), seed)
        said = _libjpeg_warns(bad)
        if said is None:
            continue  # decodes cleanly to other pixels: no decoder can tell (the documented limit)
        warned += 1
        with pytest.raises(BadImage, match="damaged JPEG"):
            prepare(bad)
    assert warned >= 8  # the seeds above give warnings; most are "extraneous bytes before marker 0xd9"


def test_extraneous_bytes_before_the_end_marker_are_damage():
    good = _photo_jpeg(3)
    bad = _rotted(good, 5)
    assert "extraneous bytes before marker 0xd9" in (_libjpeg_warns(bad) or "")
    with pytest.raises(BadImage, match="lost sync"):
        prepare(bad)


def test_stray_bytes_between_header_segments_are_an_oddity():
    good = _photo_jpeg(4)
    cut = _segment_end(good, b"\xff\xdb")
    padded = good[:cut] + b"\0" * 16 + good[cut:]
    assert "extraneous bytes before marker" in (_libjpeg_warns(padded) or "")
    p = prepare(padded)
    assert p.stored_as == "canonicalised" and "stray bytes between its header segments" in p.reason
    # ... but damage in the scan behind such padding is still found
    with pytest.raises(BadImage, match="damaged JPEG"):
        prepare(padded[:cut + 16] + _rotted(good, 5)[cut:])


def test_grayscale_jpeg_with_icc_markers_after_sof_is_stored():
    buf = io.BytesIO()
    render_image(DatasetSpec(min_side=64, max_side=128), 1, 1).convert("L").save(buf, "JPEG", quality=90)
    gray = buf.getvalue()
    sof = _segment_end(gray, b"\xff\xc0")
    odd = gray[:2] + _icc_app2(1, 1) + gray[2:sof] + _icc_app2(1, 1) + gray[sof:]
    assert "bad ICC marker" in (_libjpeg_warns(odd) or "")
    p = prepare(odd)
    assert p.stored_as == "canonicalised"
    assert np.array_equal(decode_rgb(odd), np.asarray(Image.open(io.BytesIO(odd)).convert("RGB")))
    assert np.abs(decode_rgb(p.data).astype(int) - decode_rgb(odd)).mean() < 2.0


def test_invalid_sos_parameters_of_a_sequential_jpeg_are_an_oddity():
    good = _photo_jpeg(6)
    sos = good.index(b"\xff\xda")
    se = sos + 5 + 2 * good[sos + 4] + 1
    odd = good[:se] + b"\0" + good[se + 1:]  # Se=0: a sequential decode ignores it
    assert "Invalid SOS parameters" in (_libjpeg_warns(odd) or "")
    p = prepare(odd)
    assert p.stored_as == "canonicalised" and "invalid parameters for a sequential JPEG" in p.reason
    with pytest.raises(BadImage, match="damaged JPEG"):  # damage behind it is still found
        prepare(_rotted(odd, 5))


def test_the_damage_table_finds_no_false_skip_and_no_warned_false_store():
    """tools/jpeg_damage_table.py, small: every intact kind is kept, every rotted copy libjpeg-turbo
    warns about is skipped (docs/jpeg-damage.md has the full-size run)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "jpeg_damage_table.py"
    spec = importlib.util.spec_from_file_location("jpeg_damage_table", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    rows = tool.run(copies=2, seed=1, photos=3)
    assert rows["intact_total"] >= 20 and rows["false_skips"] == []
    warned_stored = {said: c["stored"] for said, c in rows["rot"].items() if not said.endswith("clean") and c["stored"]}
    assert warned_stored == {}
    assert sum(c["skipped"] for c in rows["rot"].values()) >= rows["rot_total"] // 2
