"""The image policy: what bytes are stored, and what RGB image any bytes stand for.

Owns: recognising formats (``sniff``, ``is_jpeg``: the one magic-byte check), the
decompression-bomb limit (``check_pixels``: the one pixel check), the reference decode
(Pillow, strict: the RGB image a user sees), the structural checks that tell a damaged
file from an odd one (``png_damage``, ``jpeg_damage``), and the rule that decides whether
a file's original bytes are stored as-is or canonicalised (``prepare``).

This is the ``image/`` room, below ``store/``, ``pack/`` and ``load/``: conversion uses it to
decide what to store, ``fast.py`` falls back to it, and every reader turns its
``BadImage`` into a ``CorruptSampleError`` with ``sample_error``.

What a user sees (the reference decode): Pillow with truncated images refused, the first
frame of multi-frame files (GIF, TIFF, WebP, APNG, MPO/Ultra HDR: the primary image),
EXIF orientation 1-8 applied, then 8-bit RGB: alpha is dropped as ``convert("RGB")``
drops it (the colour channels, not composited: what ``ImageFolder`` gives), 16-bit
samples keep their high byte (``I;16*``, and ``I`` above 255), float (``F``) images are
taken as 0..1 when their maximum is at most 1, else clipped to 0..255, palettes with
``tRNS`` and every other mode go through ``convert("RGB")``. If one of those steps fails
on an image Pillow loaded, ``convert("RGB")`` of the loaded image is used instead: a file
Pillow can show is never lost to our own conversion.

Damaged versus odd (``prepare`` skips the first, canonicalises the second):

* PNG: every chunk is walked and its CRC checked, the whole zlib stream of the image data
  is inflated to its end (adler32 checked), its length must be what the header says and
  every row's filter byte must be 0-4. A broken zlib stream, a wrong length, a bad filter
  byte or a file cut inside the image data is damage. A bad CRC on an otherwise intact
  file (ancillary chunks with a bad CRC are dropped: Pillow refuses them, the pixels do
  not need them) or data after the zlib stream is odd. A file cut after its image data
  (inside IEND) is refused by Pillow's strict decode, and so skipped.
* JPEG: decoded by libjpeg-turbo (simplejpeg) in strict mode. "Premature end of data
  segment" (also when an end marker was appended to a cut file), "premature end of JPEG
  file" (no end marker), and corrupt entropy data (bad Huffman codes, ...) are damage. "Extraneous bytes before
  a marker" is odd. Limitation: libjpeg stops at its first warning, so a file whose first
  problem is extraneous bytes is not searched for later damage.
* Decompression bombs (over ``max_pixels``), empty files, files Pillow cannot open
  (including 12-bit JPEGs, which Pillow and so ``ImageFolder`` cannot read) are bad.

Store as-is rule. Original bytes are kept only for plain 8-bit RGB or grayscale JPEG
(baseline, extended or progressive Huffman, one frame) and non-interlaced 8-bit RGB or
grayscale PNG, without EXIF rotation, that pass the checks above and whose libjpeg-turbo
decode equals Pillow's pixel for pixel. Everything else is canonicalised: the reference
RGB image re-encoded, JPEG sources as JPEG quality 95 with 4:4:4 chroma, everything else
as lossless PNG. Whatever is stored (original, canonicalised or re-encoded with
``--max-side``/``--quality``) is decoded again, strictly, before it is accepted.

Must not: import torch or anything from the rooms above (``store/``, ``pack/``, ``load/``).
"""

from __future__ import annotations

import io
import os
import stat
import struct
import warnings
import zlib
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFile, ImageOps

from fastload.errors import CorruptSampleError

#: Pillow's own hard limit (2 × ``Image.MAX_IMAGE_PIXELS``): nothing Pillow accepts is refused.
DEFAULT_MAX_PIXELS = 2 * 89_478_485
#: Files larger than this are not read at conversion (``--max-file-bytes``).
DEFAULT_MAX_FILE_BYTES = 1 << 30
CANONICAL_JPEG_QUALITY = 95
#: ``--encoding auto`` stores raw pixels for images up to this many pixels (256 x 256), encoded above.
AUTO_RAW_MAX_PIXELS = 256 * 256
ENCODING_CHOICES = ("jpeg", "raw", "auto")

_JPEG_OK_SOF = {0xC0, 0xC1, 0xC2}  # baseline, extended sequential, progressive (Huffman)
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
# libjpeg-turbo warnings that mean the pixels are not all there or not what was encoded
_JPEG_DAMAGE = ("premature end", "huffman", "corrupt jpeg data: bad", "invalid", "truncated", "unexpected marker")


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


class BadImage(Exception):
    """A file that is not a usable image; ``str()`` is the reason shown to users."""


@dataclass(frozen=True)
class Prepared:
    """What to store for one source file."""

    data: bytes
    encoding: str  # "jpeg" | "png" | "raw"
    stored_as: str  # "original" | "canonicalised" | "reencoded"
    reason: str | None  # why it was canonicalised / re-encoded
    width: int
    height: int


def is_jpeg(data: bytes) -> bool:
    return data[:3] == b"\xff\xd8\xff"


def sniff(data: bytes) -> str | None:
    """The format of ``data`` from its magic bytes, or None."""
    if is_jpeg(data):
        return "jpeg"
    if data[:8] == _PNG_SIGNATURE:
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


def check_pixels(width: int, height: int, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
    """Refuse decompression bombs before any decoder allocates for them."""
    if width <= 0 or height <= 0:
        raise BadImage(f"image has zero size {width}x{height}")
    if width * height > max_pixels:
        raise BadImage(
            f"decompression bomb: {width}x{height} = {width * height:,} pixels is over the limit of "
            f"{max_pixels:,} (raise it with --max-pixels if the image is genuine)"
        )


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


def _orientation(img: Image.Image) -> int:
    try:
        return int(img.getexif().get(0x0112, 1) or 1)
    except Exception:  # a broken EXIF block must not make a good image unreadable
        return 1


def open_image(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Open (not decode) ``data`` with Pillow, refusing empty files and decompression bombs."""
    if not data:
        raise BadImage("empty file (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise BadImage(f"decompression bomb: {exc}") from None
    except Exception as exc:
        kind = sniff(data)
        frame = jpeg_frame(data) if kind == "jpeg" else None
        if frame is not None and frame[1] != 8:
            raise BadImage(f"{frame[1]}-bit JPEG: Pillow (and so torchvision's ImageFolder) cannot decode it; "
                           "convert it to 8-bit") from None
        what = f"a {kind} file that Pillow cannot open" if kind else "not an image (unrecognised header)"
        raise BadImage(f"{what}: {exc}") from None
    check_pixels(*img.size, max_pixels)
    return img


def _mode_to_rgb(img: Image.Image) -> Image.Image:
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        arr = np.asarray(img)
        if img.mode == "I" and arr.max(initial=0) <= 255 and arr.min(initial=0) >= 0:
            arr = arr.astype(np.uint8)
        else:  # 16-bit samples: keep the high byte, as Pillow does for 16-bit RGB
            arr = (np.clip(arr, 0, 65535).astype(np.uint32) >> 8).astype(np.uint8)
        return Image.fromarray(arr, "L").convert("RGB")
    if img.mode == "F":
        arr = np.nan_to_num(np.asarray(img, dtype=np.float32))
        if arr.max(initial=0.0) <= 1.0:
            arr = arr * 255.0
        return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), "L").convert("RGB")
    return img.convert("RGB")


def to_rgb(img: Image.Image) -> Image.Image:
    """Decode ``img`` (strictly) to the 8-bit RGB image a user would see (see the module docstring)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # palette-transparency and EXIF warnings
            img.load()
    except Exception as exc:
        raise BadImage(f"decode failed: {exc}") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if _orientation(img) != 1:
            try:
                img = ImageOps.exif_transpose(img)
            except Exception:  # an unreadable orientation is not worth losing the image
                pass
        try:
            out = _mode_to_rgb(img)
        except Exception:
            try:
                out = img.convert("RGB")
            except Exception as exc:
                raise BadImage(f"cannot convert {img.mode} pixels to RGB: {exc}") from None
    out.info = {}  # never carry transparency, ICC or EXIF of the source into a re-encode
    return out


def decode_reference(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """The reference decode: ``data`` → the PIL RGB image a user sees."""
    return to_rgb(open_image(data, max_pixels=max_pixels))


def decode_rgb(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Reference decode: ``data`` → HWC uint8 RGB array (writable), as a user would see it."""
    return np.array(decode_reference(data, max_pixels=max_pixels))


# ---- damage checks ---------------------------------------------------------------------------


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
                odd.append(_DROP)
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


_DROP = "drop ancillary chunks with bad CRCs"


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


# ---- what to store ---------------------------------------------------------------------------


def _as_is_obstacle(data: bytes, kind: str | None, img: Image.Image) -> str | None:
    """Why the original bytes cannot be stored as they are, or None when they can."""
    frames = getattr(img, "n_frames", 1)
    if frames > 1:
        return f"{img.format or kind} with {frames} frames (first frame kept)"
    if kind == "jpeg":
        frame = jpeg_frame(data)
        if frame is None:
            return "JPEG without a readable frame header"
        sof, precision, comps = frame
        if sof not in _JPEG_OK_SOF:
            return f"JPEG coding not every decoder supports (SOF 0x{sof:02X})"
        if precision != 8:
            return f"{precision}-bit JPEG"
        if img.mode not in ("RGB", "L") or comps not in (1, 3):
            return f"JPEG in {img.mode} colour"
    elif kind == "png":
        depth, colour, interlace = data[24], data[25], data[28]
        if depth != 8:
            return f"{depth}-bit PNG"
        if colour not in (0, 2):
            return {3: "palette PNG", 4: "grayscale+alpha PNG", 6: "RGBA PNG"}.get(colour, f"PNG colour type {colour}")
        if interlace:
            return "interlaced PNG"
    else:
        return f"{kind or img.format or 'unknown'} format"
    orientation = _orientation(img)
    if orientation != 1:
        return f"EXIF orientation {orientation}"
    return None


def _encode(img: Image.Image, fmt: str, quality: int = CANONICAL_JPEG_QUALITY, subsampling: int = 2) -> bytes:
    buf = io.BytesIO()
    if fmt == "jpeg":
        img.save(buf, "JPEG", quality=quality, subsampling=subsampling, optimize=False)
    else:
        img.save(buf, "PNG", compress_level=3)
    return buf.getvalue()


def _accept(data: bytes, encoding: str, rgb: np.ndarray | None, size: tuple[int, int]) -> None:
    """Decode what is about to be stored, strictly, with the decoder the loaders use on it."""
    if encoding == "jpeg":
        damage, fast = jpeg_damage(data)
        if damage or fast is None or fast.shape[:2] != (size[1], size[0]):
            raise BadImage(f"internal error: the re-encoded JPEG does not decode cleanly ({damage})")
        return
    png_damage(data)
    back = np.asarray(decode_reference(data))
    if rgb is not None and not np.array_equal(back, rgb):
        raise BadImage("internal error: the lossless PNG re-encode does not decode to the same pixels")


def prepare(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS, max_side: int | None = None,
            quality: int | None = None, encoding: str = "jpeg") -> Prepared:
    """Validate one file and decide what to store for it (the rules are in the module docstring).

    Args:
        data: the file's bytes.
        max_pixels: refuse images with more pixels (decompression bombs).
        max_side: re-encode images whose longer side exceeds this, downscaled to it.
        quality: JPEG quality for re-encoding; given without ``max_side`` it re-encodes
            every image at that quality.
        encoding: ``"jpeg"``: encoded images (originals where the rule allows);
            ``"raw"``: every image as raw RGB pixels (after ``max_side``); ``"auto"``: raw
            for images of at most ``AUTO_RAW_MAX_PIXELS`` pixels (after ``max_side``),
            encoded above.

    Raises:
        BadImage: the file is damaged or not a usable image; the message says why.
    """
    kind = sniff(data)
    img = open_image(png_without_bad_chunks(data) if kind == "png" else data, max_pixels=max_pixels)
    odd: list[str] = []
    fast = None
    source = data
    if kind == "png":
        odd = png_damage(data)
        if _DROP in odd:
            odd.remove(_DROP)
            source = png_without_bad_chunks(data)
    elif kind == "jpeg":
        odd, fast = jpeg_damage(data)
    rgb_img = decode_reference(source, max_pixels=max_pixels)  # a fresh, strict decode
    rgb = np.asarray(rgb_img)
    w, h = rgb_img.size
    obstacle = odd[0] if odd else _as_is_obstacle(data, kind, img)
    if obstacle is None and kind == "jpeg" and (fast is None or not np.array_equal(fast, rgb)):
        obstacle = "JPEG that libjpeg-turbo and Pillow decode to different pixels"
    resize = max_side is not None and max(w, h) > max_side
    if encoding not in ENCODING_CHOICES:
        raise ValueError(f"Unknown value {encoding!r} for argument encoding. Valid values are {ENCODING_CHOICES}.")
    if encoding != "jpeg":
        out_size = (w, h)
        if resize:
            scale = max_side / max(w, h)  # type: ignore[operator]
            out_size = (max(1, round(w * scale)), max(1, round(h * scale)))
        if encoding == "raw" or out_size[0] * out_size[1] <= AUTO_RAW_MAX_PIXELS:
            out_img = rgb_img.resize(out_size, Image.LANCZOS, reducing_gap=3.0) if resize else rgb_img
            why = "raw pixels" + (f", downscaled to longer side {max_side}" if resize else "")
            return Prepared(encode_raw(np.asarray(out_img)), "raw", "reencoded", why, *out_size)
    reencode = resize or (quality is not None and max_side is None)
    if obstacle is None and not reencode:
        return Prepared(data, kind, "original", None, w, h)  # type: ignore[arg-type]
    if reencode:
        out_img = rgb_img
        if resize:
            scale = max_side / max(w, h)  # type: ignore[operator]
            size = (max(1, round(w * scale)), max(1, round(h * scale)))
            out_img = rgb_img.resize(size, Image.LANCZOS, reducing_gap=3.0)
        q = quality if quality is not None else 90
        why = f"downscaled to longer side {max_side}" if resize else f"re-encoded at quality {q}"
        out = _encode(out_img, "jpeg", q)
        _accept(out, "jpeg", None, out_img.size)
        return Prepared(out, "jpeg", "reencoded", why, *out_img.size)
    if kind == "jpeg":
        out = _encode(rgb_img, "jpeg", CANONICAL_JPEG_QUALITY, subsampling=0)
        _accept(out, "jpeg", None, rgb_img.size)
        return Prepared(out, "jpeg", "canonicalised", obstacle, w, h)
    out = _encode(rgb_img, "png")
    _accept(out, "png", rgb, rgb_img.size)
    return Prepared(out, "png", "canonicalised", obstacle, w, h)


def read_source_file(path: str, *, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> bytes:
    """The bytes of one regular file, refusing FIFOs, devices, sockets and oversized files.

    Raises:
        BadImage: the reason it was not read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise BadImage("file not found") from None
    except IsADirectoryError:
        raise BadImage("is a directory, not a file") from None
    except PermissionError:
        raise BadImage("permission denied") from None
    except OSError as exc:
        raise BadImage(f"cannot read: {exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a file")
            raise BadImage(f"not a regular file ({kind}); only regular files are read")
        if st.st_size > max_bytes:
            raise BadImage(f"file is {st.st_size:,} bytes, over the limit of {max_bytes:,} "
                           "(raise it with --max-file-bytes)")
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = -1
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise BadImage(f"file grew past the limit of {max_bytes:,} bytes while being read")
        return data
    finally:
        if fd >= 0:
            os.close(fd)


def _within(real: str, folder: str) -> bool:
    return real == folder or real.startswith(folder.rstrip(os.sep) + os.sep)


def prepare_file(path: str, options: dict) -> tuple:
    """Worker entry point: read and prepare one file (``options``: ``prepare``'s keywords,
    ``max_file_bytes``, and ``inside``: when set, a path whose real location is outside that
    folder, through a symbolic link, is not read).

    Returns:
        ``("ok", data, encoding, stored_as, reason)`` or ``("bad", reason)``.
    """
    ImageFile.LOAD_TRUNCATED_IMAGES = False  # strict in every conversion worker, whatever was imported
    opts = dict(options)
    max_bytes = opts.pop("max_file_bytes", DEFAULT_MAX_FILE_BYTES)
    inside = opts.pop("inside", None)
    try:
        real = os.path.realpath(path)
        if inside is not None and real != os.path.abspath(path) and not _within(real, inside):
            raise BadImage(f"symbolic link to {real}, outside the source; pass --follow-symlinks to read it")
        p = prepare(read_source_file(path, max_bytes=max_bytes), **opts)
    except BadImage as exc:
        return ("bad", str(exc))
    except MemoryError:
        return ("bad", "out of memory while decoding")
    return ("ok", p.data, p.encoding, p.stored_as, p.reason)


def sample_error(store: object, index: int, relpath: str | None, exc: BaseException) -> CorruptSampleError:
    """The error for sample ``index`` of ``store`` failing to decode."""
    if isinstance(exc, CorruptSampleError):
        return exc
    name = f" ({relpath})" if relpath else ""
    reason = str(exc) if isinstance(exc, BadImage) else f"{type(exc).__name__}: {exc}"
    return CorruptSampleError(
        f"{store}: sample {index}{name} failed to decode: {reason}\n"
        f"HINT: run `fastload verify {store}` to list every bad sample; on_error='skip' "
        "skips bad samples instead of raising.",
        index=index, relpath=relpath,
    )
