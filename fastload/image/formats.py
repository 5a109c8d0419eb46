"""Recognising image bytes: magic numbers, JPEG frame headers, fastload's raw-pixel records.

Owns: ``is_jpeg`` / ``sniff`` (the one magic-byte check), ``jpeg_frame`` (SOF, precision,
components from the marker segments), the raw record format (``encode_raw``,
``raw_header``: a binary PPM, which Pillow and DALI read too) and ``BadImage``, the error
every image function raises for unusable bytes.

Must not: decode pixels (``policy.py``, ``fast.py``), or import torch.
"""

from __future__ import annotations

import struct

import numpy as np

__all__ = ["BadImage", "is_jpeg", "sniff", "jpeg_frame", "encode_raw", "raw_header"]

_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class BadImage(Exception):
    """A file that is not a usable image; ``str()`` is the reason shown to users."""


def is_jpeg(data: bytes) -> bool:
    return data[:3] == b"\xff\xd8\xff"


def sniff(data: bytes) -> str | None:
    """The format of ``data`` from its magic bytes, or None."""
    if is_jpeg(data):
        return "jpeg"
    if data[:8] == PNG_SIGNATURE:
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if data[:2] == b"BM":
        return "bmp"
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"
    if len(data) > 2 and data[0:1] == b"P" and data[1:2] in b"123456" and data[2:3].isspace():
        return "pnm"
    return None


def jpeg_frame(data: bytes) -> tuple[int, int, int] | None:
    """(SOF marker, sample precision, components) of a JPEG, from its marker segments."""
    pos = 2
    n = len(data)
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            pos += 2
            continue
        (length,) = struct.unpack(">H", data[pos + 2:pos + 4])
        if marker in _JPEG_SOF and pos + 10 <= n:
            return marker, data[pos + 4], data[pos + 9]
        if marker == 0xDA:  # start of scan before any frame header
            return None
        pos += 2 + length
    return None


def encode_raw(rgb: np.ndarray) -> bytes:
    """Raw pixels as a binary PPM (P6, 8-bit RGB): no decode to read, and every decoder here reads PPM."""
    h, w = rgb.shape[:2]
    return b"P6\n%d %d\n255\n" % (w, h) + np.ascontiguousarray(rgb, dtype=np.uint8).tobytes()


def raw_header(data: bytes) -> tuple[int, int, int] | None:
    """``(height, width, offset of the pixels)`` of a record written by ``encode_raw``, else None."""
    if data[:3] != b"P6\n":
        return None
    end = data.find(b"\n255\n", 3, 40)
    if end < 0:
        return None
    try:
        w, h = (int(v) for v in data[3:end].split(b" "))
    except ValueError:
        return None
    off = end + 5
    return (h, w, off) if len(data) == off + 3 * w * h else None
