"""Damaged or odd: the structural checks ``policy.prepare`` runs on PNG and JPEG bytes.

Owns: walking a PNG's chunks (CRCs, the whole zlib image stream, its length and every
row's filter byte), dropping ancillary chunks with bad CRCs, and the strict libjpeg-turbo
decode of a JPEG with its warnings sorted into damage (``BadImage``) and oddities (returned
as reasons to canonicalise). The rule is written in ``policy.py``'s docstring.

Must not: decide what is stored (``policy.py``), or import torch.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

from fastload.image.formats import BadImage, jpeg_frame

__all__ = ["png_damage", "png_without_bad_chunks", "jpeg_damage", "DROP_BAD_CHUNKS"]

_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
# libjpeg-turbo warnings that mean the pixels are not all there or not what was encoded
_JPEG_DAMAGE = ("premature end", "huffman", "corrupt jpeg data: bad", "invalid", "truncated", "unexpected marker")


def png_damage(data: bytes) -> list[str]:
    """Check a PNG's structure and image data stream.

    Returns:
        Reasons it is odd but intact (empty when it is clean).

    Raises:
        BadImage: the image data is damaged or incomplete.
    """
    odd: list[str] = []
    pos, n = 8, len(data)
    header = None
    idat: list[bytes] = []
    seen_iend = after_idat = False
    while pos < n:
        if pos + 8 > n:
            break
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        end = pos + 12 + length
        if length > 0x7FFFFFFF or end > n:
            if kind == b"IDAT" or not after_idat:
                raise BadImage(f"damaged PNG: cut short inside its {kind.decode('latin-1')!r} chunk "
                               "(the image data is incomplete)")
            odd.append(f"PNG cut short after its image data (inside {kind.decode('latin-1')!r})")
            break
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:end])
        if zlib.crc32(kind + body) != crc:
            odd.append(f"PNG chunk {kind.decode('latin-1')!r} has a bad CRC")
            if kind[:1].islower():  # ancillary: Pillow refuses the file, the pixels do not need it
                odd.append(DROP_BAD_CHUNKS)
        if kind == b"IHDR":
            if length != 13:
                raise BadImage("damaged PNG: its IHDR chunk is not 13 bytes")
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            if after_idat:
                raise BadImage("damaged PNG: its IDAT chunks are not consecutive")
            idat.append(body)
        elif idat:
            after_idat = True
        if kind == b"IEND":
            seen_iend = True
            break
        pos = end
    if header is None:
        raise BadImage("damaged PNG: no IHDR chunk")
    if not idat:
        raise BadImage("damaged PNG: no image data (IDAT)")
    if not seen_iend and not any("cut short" in o for o in odd):
        odd.append("PNG without an IEND chunk")
    width, height, depth, colour, _, _, interlace = header
    if colour not in _PNG_CHANNELS or depth not in (1, 2, 4, 8, 16):
        raise BadImage(f"damaged PNG: invalid colour type {colour} / bit depth {depth}")
    bits = _PNG_CHANNELS[colour] * depth
    passes = _ADAM7 if interlace else ((0, 0, 1, 1),)
    rows: list[tuple[int, int]] = []  # (row count, bytes per row incl. the filter byte) per pass
    for x0, y0, dx, dy in passes:
        pw, ph = (width - x0 + dx - 1) // dx, (height - y0 + dy - 1) // dy
        if pw > 0 and ph > 0:
            rows.append((ph, 1 + (pw * bits + 7) // 8))
    expected = sum(r * b for r, b in rows)
    raw = _inflate(b"".join(idat), expected)
    if len(raw.data) != expected:
        raise BadImage(f"damaged PNG: its image data holds {len(raw.data):,} bytes, the header needs {expected:,}")
    if raw.extra:
        odd.append("PNG with extra data after its image stream")
    off = 0
    for count, step in rows:
        filters = np.frombuffer(raw.data, dtype=np.uint8, count=count * step, offset=off)[::step]
        if filters.size and int(filters.max()) > 4:
            raise BadImage(f"damaged PNG: bad row filter value {int(filters.max())} (the image data is corrupt)")
        off += count * step
    return odd


DROP_BAD_CHUNKS = "drop ancillary chunks with bad CRCs"


def png_without_bad_chunks(data: bytes) -> bytes:
    """The PNG with its ancillary chunks whose CRC is wrong left out (they carry no pixels)."""
    out, pos = [data[:8]], 8
    while pos + 12 <= len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        end = pos + 12 + length
        if end > len(data):
            break
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        bad = zlib.crc32(kind + body) != struct.unpack(">I", data[end - 4:end])[0]
        if not (bad and kind[:1].islower()):
            out.append(data[pos:end])
        pos = end
    out.append(data[pos:])
    return b"".join(out)


@dataclass
class _Inflated:
    data: bytes
    extra: bool


def _inflate(stream: bytes, expected: int) -> _Inflated:
    d = zlib.decompressobj()
    try:
        out = d.decompress(stream, expected + 1)
        if not d.eof and len(out) <= expected:
            out += d.flush()
    except zlib.error as exc:
        raise BadImage(f"damaged PNG: its image data does not inflate ({exc})") from None
    if not d.eof:
        if len(out) > expected:
            raise BadImage("damaged PNG: its image data is longer than the header says")
        raise BadImage("damaged PNG: its image data stream ends early (the file was cut or corrupted)")
    return _Inflated(out, bool(d.unused_data.strip(b"\0")))


def jpeg_damage(data: bytes) -> tuple[list[str], np.ndarray | None]:
    """Decode a JPEG with libjpeg-turbo in strict mode.

    Returns:
        ``(odd reasons, RGB pixels or None)``: pixels when libjpeg-turbo decoded it to RGB
        without a warning; reasons when it is odd but intact.

    Raises:
        BadImage: scan data ends early, the end of image is missing, or the entropy-coded
            data is corrupt.
    """
    import simplejpeg

    frame = jpeg_frame(data)
    colorspace = "CMYK" if frame is not None and frame[2] == 4 else "RGB"
    try:
        arr = simplejpeg.decode_jpeg(data, colorspace=colorspace, strict=True)
    except ValueError as exc:
        msg = str(exc)
        low = msg.lower()
        if "extraneous bytes" in low:
            return [f"JPEG with extraneous bytes ({msg})"], None
        if "unsupported" in low or "not supported" in low:
            return [], None  # libjpeg-turbo's TurboJPEG API cannot decode it: Pillow decides
        if "premature end of jpeg file" in low:
            raise BadImage(f"damaged JPEG: truncated, the file ends before its image data does ({msg})") from None
        if "premature end of data segment" in low:
            raise BadImage(f"damaged JPEG: its scan data ends early, the file was cut and possibly "
                           f"'repaired' ({msg})") from None
        if any(word in low for word in _JPEG_DAMAGE) or "corrupt" in low:
            raise BadImage(f"damaged JPEG: {msg}") from None
        return [f"JPEG libjpeg-turbo warns about ({msg})"], None
    return [], (arr if colorspace == "RGB" else None)
