"""Every 16-bit PNG mode against the documented rule (``image.policy``): the high byte of each
16-bit sample, alpha and tRNS dropped as ``convert("RGB")`` drops them (docs/jpeg-damage.md)."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from fastload.image.policy import decode_rgb, prepare
from helpers import png_chunk

_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def _png16(samples: np.ndarray, colour: int, *, trns: bytes | None = None, interlace: bool = False) -> bytes:
    """A 16-bit PNG written from ``samples`` (H×W×channels uint16) by hand, Adam7 when ``interlace``."""
    h, w = samples.shape[:2]
    passes = _ADAM7 if interlace else ((0, 0, 1, 1),)
    raw = b""
    for x0, y0, dx, dy in passes:
        sub = samples[y0::dy, x0::dx]
        if sub.size:
            raw += b"".join(b"\0" + row.astype(">u2").tobytes() for row in sub)
    chunks = [png_chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, colour, 0, 0, int(interlace)))]
    if trns is not None:
        chunks.append(png_chunk(b"tRNS", trns))
    chunks += [png_chunk(b"IDAT", zlib.compress(raw)), png_chunk(b"IEND", b"")]
    return b"\x89PNG\r\n\x1a\n" + b"".join(chunks)


def _samples(channels: int, seed: int) -> np.ndarray:
    """Smooth ramps plus noise over the whole 16-bit range (and a dark corner whose values are all < 256)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:24, 0:37]
    base = (x * 65535 // 36)[..., None] + rng.integers(-3000, 3000, (24, 37, channels))
    out = np.clip(base, 0, 65535).astype(np.uint16)
    out[:6, :6] = rng.integers(0, 256, (6, 6, channels))
    return out


MODES = {  # name: (colour type, channels, tRNS builder from the samples)
    "gray16 (I;16)": (0, 1, None),
    "gray16+tRNS": (0, 1, lambda s: struct.pack(">H", int(s[3, 3, 0]))),
    "gray16+alpha16": (4, 2, None),
    "RGB48": (2, 3, None),
    "RGB48+tRNS": (2, 3, lambda s: struct.pack(">HHH", *(int(v) for v in s[3, 3]))),
    "RGBA64": (6, 4, None),
}


@pytest.mark.parametrize("interlace", [False, True], ids=["plain", "adam7"])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_16_bit_mode_follows_the_high_byte_rule(mode, interlace):
    colour, channels, trns = MODES[mode]
    samples = _samples(channels, seed=colour + channels)
    data = _png16(samples, colour, trns=trns(samples) if trns else None, interlace=interlace)
    colours = samples[..., :1] if channels <= 2 else samples[..., :3]
    want = np.broadcast_to((colours >> 8).astype(np.uint8), samples.shape[:2] + (3,))
    assert np.array_equal(decode_rgb(data), want)
    exact = prepare(data, lossless=True)
    assert exact.stored_as == "canonicalised" and np.array_equal(decode_rgb(exact.data), want)
    lossy = prepare(data)
    assert np.abs(decode_rgb(lossy.data).astype(int) - want).mean() < 4.0
