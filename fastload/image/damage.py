"""Damaged or odd: the structural checks ``policy.prepare`` runs on PNG and JPEG bytes.

Owns: walking a PNG's chunks (CRCs, the whole zlib image stream, its length and every
row's filter byte), dropping ancillary chunks with bad CRCs, and the strict libjpeg-turbo
decode of a JPEG with its warnings sorted into damage (``BadImage``: anything from the scan
data) and oddities (returned as reasons to canonicalise: the header's stray bytes and
metadata). The rule is written in ``policy.py``'s docstring and measured in docs/jpeg-damage.md.

Must not: decide what is stored (``policy.py``), or import torch.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

from fastload.image.formats import BadImage, jpeg_frame

__all__ = ["png_damage", "png_without_bad_chunks", "jpeg_damage", "jpeg_header_cleaned", "bad_crc_chunks",
           "DROP_BAD_CHUNKS"]

_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


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
            where = _chunk_at(kind, pos, length, n)
            if kind == b"IDAT" or not after_idat:
                raise BadImage(f"damaged PNG: cut short {where} (the image data is incomplete)")
            odd.append(f"PNG cut short after its image data ({where})")
            break
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:end])
        if zlib.crc32(kind + body) != crc:
            odd.append(f"PNG {_chunk_name(kind, pos)} has a bad CRC")
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


def _chunk_name(kind: bytes, pos: int) -> str:
    """A chunk named readably: its type when that is four ASCII letters (as every real one is),
    else where it is and the bytes that stand in for a type (a garbled length or type)."""
    if kind.isascii() and kind.isalpha() and len(kind) == 4:
        return f"chunk {kind.decode('ascii')}"
    return f"chunk at byte {pos:,} with an unreadable type (bytes {kind.hex(' ')})"


def _chunk_at(kind: bytes, pos: int, length: int, n: int) -> str:
    """Where a PNG broke off, readably: the chunk (or, for a header that is garbage, its offset
    and bytes), the length it claims and how many bytes the file has left."""
    left = max(0, n - pos - 8)
    if kind.isascii() and kind.isalpha() and len(kind) == 4:
        return (f"inside its {kind.decode('ascii')} chunk at byte {pos:,} (it claims {length:,} bytes; "
                f"{left:,} are left)")
    return (f"at byte {pos:,}, where the next chunk header is unreadable (type bytes {kind.hex(' ')}, claimed "
            f"length {length:,}; {left:,} bytes are left)")


def bad_crc_chunks(data: bytes) -> list[str]:
    """Types of the ancillary chunks whose CRC is wrong (those ``png_without_bad_chunks`` leaves out)."""
    out, pos = [], 8
    while pos + 12 <= len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        end = pos + 12 + length
        if end > len(data):
            break
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind[:1].islower() and zlib.crc32(kind + body) != struct.unpack(">I", data[end - 4:end])[0]:
            out.append(_chunk_name(kind, pos).removeprefix("chunk "))
        pos = end
    return out


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


#: libjpeg-turbo warnings about metadata only: the pixels are whole (the file is canonicalised)
_JPEG_METADATA = ("unknown jfif revision", "unknown adobe color transform", "thumbnail image size")


def _strict_jpeg(data: bytes, colorspace: str) -> tuple[np.ndarray | None, str | None]:
    import simplejpeg

    try:
        return simplejpeg.decode_jpeg(data, colorspace=colorspace, strict=True), None
    except ValueError as exc:
        return None, str(exc)


def jpeg_header_cleaned(data: bytes) -> tuple[bytes, list[str]]:
    """The JPEG with what libjpeg-turbo warns about in its header but does not need set aside,
    and what was set aside.

    That is: stray bytes between the header segments (before the first scan; an encoder's
    padding), ICC profile markers (libjpeg-turbo's "bad ICC marker" is about metadata), and,
    in a sequential JPEG, scan headers whose spectral selection or approximation fields are
    not 0/63/0 ("Invalid SOS parameters for sequential JPEG": a sequential decode ignores
    them). Everything else, the entropy-coded data above all, is kept byte for byte.
    """
    out, pos, n, dropped, icc = [data[:2]], 2, len(data), 0, False
    while pos < n:
        if data[pos] != 0xFF or pos + 1 >= n or data[pos + 1] == 0x00:
            nxt = pos + 1
            while nxt + 1 < n and not (data[nxt] == 0xFF and data[nxt + 1] not in (0x00, 0xFF)):
                nxt += 1
            if nxt + 1 >= n:
                break  # no marker follows: leave the rest out (the decode of what is kept decides)
            dropped += nxt - pos
            pos = nxt
            continue
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0xDA, 0xD9):  # the scan (or the end) from here on: kept byte for byte
            out.append(data[pos:])
            break
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            out.append(data[pos:pos + 2])
            pos += 2
            continue
        if pos + 4 > n:
            out.append(data[pos:])
            break
        end = pos + 2 + struct.unpack(">H", data[pos + 2:pos + 4])[0]
        if marker == 0xE2 and data[pos + 4:pos + 16] == b"ICC_PROFILE\0":
            icc = True
        else:
            out.append(data[pos:end])
        pos = end
    cleaned = bytearray(b"".join(out))
    notes = [f"{dropped} stray bytes between its header segments"] if dropped else []
    if icc:
        notes.append("ICC profile markers")
    frame = jpeg_frame(data)
    if frame is not None and frame[0] in (0xC0, 0xC1, 0xC9):  # sequential: Ss, Se, Ah/Al are fixed
        fixed, at = False, 0
        while (i := cleaned.find(b"\xff\xda", at)) >= 0:  # entropy-coded data never holds FF DA
            at = i + 2
            p = i + 5 + 2 * (cleaned[i + 4] if i + 4 < len(cleaned) else 0)
            if p + 3 <= len(cleaned) and bytes(cleaned[p:p + 3]) != b"\x00\x3f\x00":
                cleaned[p:p + 3] = b"\x00\x3f\x00"
                fixed = True
        if fixed:
            notes.append("scan headers with invalid parameters for a sequential JPEG")
    return bytes(cleaned), notes


def jpeg_damage(data: bytes) -> tuple[list[str], np.ndarray | None]:
    """Decode a JPEG with libjpeg-turbo in strict mode; sort its warning into damage or oddity.

    libjpeg-turbo stops at its first warning, so a warning about the header (stray bytes
    between segments, a malformed ICC profile marker, invalid scan-header fields of a
    sequential JPEG) is checked by decoding again with those set aside
    (``jpeg_header_cleaned``): only a clean decode of the rest makes the file odd. A
    warning from the scan data is damage: "N extraneous bytes before marker 0xd9 / RSTn /
    DHT / SOS" there means the scan ended before its data did (the decoder lost sync, as bit
    rot does), and bad Huffman codes, wrong restart markers, unknown markers and premature
    ends mean pixels are missing or wrong. The measured table is in docs/jpeg-damage.md.

    Returns:
        ``(odd reasons, RGB pixels or None)``: pixels when libjpeg-turbo decoded it to RGB
        without a warning; reasons when it is odd but intact.

    Raises:
        BadImage: the scan data is corrupt or ends early, or the end of image is missing.
    """
    frame = jpeg_frame(data)
    colorspace = "CMYK" if frame is not None and frame[2] == 4 else "RGB"
    arr, msg = _strict_jpeg(data, colorspace)
    if msg is None:
        return [], (arr if colorspace == "RGB" else None)
    cleaned, notes = jpeg_header_cleaned(data)
    if cleaned != data:
        _, again = _strict_jpeg(cleaned, colorspace)
        if again is None:
            return [f"JPEG whose header libjpeg-turbo warns about ({msg}); with its {' and '.join(notes)} "
                    "set aside it decodes cleanly"], None
        msg = again
    low = msg.lower()
    if any(word in low for word in _JPEG_METADATA):
        return [f"JPEG with odd metadata, pixels intact (libjpeg-turbo: {msg})"], None
    if "extraneous bytes" in low:
        raise BadImage(f"damaged JPEG: its scan data ends before the decoder expected, the decoder lost "
                       f"sync (bit rot or a corrupted copy) ({msg})") from None
    if "premature end of jpeg file" in low:
        raise BadImage(f"damaged JPEG: truncated, the file ends before its image data does ({msg})") from None
    if "premature end of data segment" in low:
        raise BadImage(f"damaged JPEG: its scan data ends early, the file was cut and possibly "
                       f"'repaired', or its data is corrupt ({msg})") from None
    if "unsupported marker" in low:
        raise BadImage(f"damaged JPEG: an invalid marker inside its data ({msg})") from None
    if "unsupported" in low or "not supported" in low or "sorry" in low:
        return [], None  # a coding libjpeg-turbo's TurboJPEG API cannot decode: Pillow decides
    raise BadImage(f"damaged JPEG: {msg}") from None
