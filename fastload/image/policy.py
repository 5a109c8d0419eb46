"""The image policy: what bytes are stored, and what RGB image any bytes stand for.

Owns: recognising formats, the reference decode (Pillow: the RGB image a user would see,
EXIF orientation applied), the decompression-bomb limit, and the rule that decides
whether a file's original bytes can be stored as-is or must be normalised.

This is the ``image/`` room, below ``store/``, ``pack/`` and ``load/``: conversion uses it to
decide what to store, ``fast.py`` falls back to it, and every reader turns its
``BadImage`` into a ``CorruptSampleError`` with ``sample_error``; there is one policy for
the whole project.

Store as-is rule. Decoders (Pillow, ``torchvision.io``, simplejpeg, DALI CPU and nvJPEG)
agree on the pixels of a plain 8-bit RGB or grayscale JPEG (baseline, extended or
progressive Huffman) or PNG without EXIF rotation. They disagree on everything else:
EXIF orientation, CMYK/YCCK, 12-bit or arithmetic-coded JPEGs, alpha, palettes, 16-bit
PNG, WebP, TIFF, BMP. Those are normalised: decoded here (orientation applied, 8-bit RGB,
alpha dropped as ``Image.convert("RGB")`` drops it, 16-bit scaled by keeping the high
byte) and re-encoded, JPEG sources as JPEG quality 95 with 4:4:4 chroma, everything else
as lossless PNG.

Must not: import torch or anything from the rooms above (``store/``, ``pack/``, ``load/``).
"""

from __future__ import annotations

import io
import struct
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from fastload.errors import CorruptSampleError

#: Pillow's own hard limit (2 × ``Image.MAX_IMAGE_PIXELS``): nothing Pillow accepts is refused.
DEFAULT_MAX_PIXELS = 2 * 89_478_485
NORMALISED_JPEG_QUALITY = 95

_JPEG_OK_SOF = {0xC0, 0xC1, 0xC2}  # baseline, extended sequential, progressive (Huffman)
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


class BadImage(Exception):
    """A file that is not a usable image; ``str()`` is the reason shown to users."""


@dataclass(frozen=True)
class Prepared:
    """What to store for one source file."""

    data: bytes
    encoding: str  # "jpeg" | "png"
    stored_as: str  # "original" | "normalised" | "reencoded"
    reason: str | None  # why it was normalised / re-encoded
    width: int
    height: int


def sniff(data: bytes) -> str | None:
    """The format of ``data`` from its magic bytes, or None."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
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


def _jpeg_frame(data: bytes) -> tuple[int, int, int] | None:
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


def _png_header(data: bytes) -> tuple[int, int]:
    """(bit depth, colour type) from a PNG's IHDR."""
    return data[24], data[25]


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
        what = f"a {kind} file that Pillow cannot open" if kind else "not an image (unrecognised header)"
        raise BadImage(f"{what}: {exc}") from None
    w, h = img.size
    if w <= 0 or h <= 0:
        raise BadImage(f"image has zero size {w}x{h}")
    if w * h > max_pixels:
        raise BadImage(
            f"decompression bomb: {w}x{h} = {w * h:,} pixels is over the limit of {max_pixels:,} "
            "(raise it with --max-pixels if the image is genuine)"
        )
    return img


def to_rgb(img: Image.Image) -> Image.Image:
    """Decode ``img`` to the 8-bit RGB image a user would see (EXIF orientation applied)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # palette-transparency and EXIF warnings
            img.load()
            if _orientation(img) != 1:
                img = ImageOps.exif_transpose(img)
            if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
                arr = np.asarray(img)
                if img.mode == "I" and arr.max(initial=0) <= 255:
                    arr = arr.astype(np.uint8)
                else:  # 16-bit samples: keep the high byte, as Pillow does for 16-bit RGB
                    arr = (np.clip(arr, 0, 65535).astype(np.uint32) >> 8).astype(np.uint8)
                img = Image.fromarray(arr, "L")
            elif img.mode == "F":
                img = Image.fromarray(np.clip(np.asarray(img), 0, 255).astype(np.uint8), "L")
            return img.convert("RGB")
    except BadImage:
        raise
    except Exception as exc:
        raise BadImage(f"decode failed: {exc}") from None


def decode_rgb(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Reference decode: ``data`` → HWC uint8 RGB array (writable), as a user would see it."""
    return np.array(to_rgb(open_image(data, max_pixels=max_pixels)))


def _as_is_obstacle(data: bytes, kind: str | None, img: Image.Image) -> str | None:
    """Why the original bytes cannot be stored as they are, or None when they can."""
    if kind == "jpeg":
        frame = _jpeg_frame(data)
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
        depth, colour = _png_header(data)
        if depth != 8:
            return f"{depth}-bit PNG"
        if colour not in (0, 2):
            return {3: "palette PNG", 4: "grayscale+alpha PNG", 6: "RGBA PNG"}.get(colour, f"PNG colour type {colour}")
    else:
        return f"{kind or img.format or 'unknown'} format"
    orientation = _orientation(img)
    if orientation != 1:
        return f"EXIF orientation {orientation}"
    return None


def _check_decodes(data: bytes, kind: str) -> str | None:
    """Decode the original bytes fully; a reason if the fast decoder rejects them."""
    if kind == "jpeg":
        import simplejpeg

        try:
            simplejpeg.decode_jpeg(data, colorspace="RGB")
        except Exception as exc:
            return f"fast JPEG decoder rejects it ({exc})"
        return None
    return None


def _encode(img: Image.Image, fmt: str, quality: int, subsampling: int = 2) -> bytes:
    buf = io.BytesIO()
    if fmt == "jpeg":
        img.save(buf, "JPEG", quality=quality, subsampling=subsampling, optimize=False)
    else:
        img.save(buf, "PNG", compress_level=3)
    return buf.getvalue()


def prepare(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS, max_side: int | None = None,
            quality: int | None = None) -> Prepared:
    """Validate one file and decide what to store for it.

    Args:
        data: the file's bytes.
        max_pixels: refuse images with more pixels (decompression bombs).
        max_side: re-encode images whose longer side exceeds this, downscaled to it.
        quality: JPEG quality for re-encoding; given without ``max_side`` it re-encodes
            every image at that quality.

    Raises:
        BadImage: the file is not a usable image; the message says why.
    """
    img = open_image(data, max_pixels=max_pixels)
    kind = sniff(data)
    w, h = img.size
    obstacle = _as_is_obstacle(data, kind, img)
    resize = max_side is not None and max(w, h) > max_side
    reencode = resize or (quality is not None and max_side is None)
    if obstacle is None and not reencode:
        problem = _check_decodes(data, kind)  # type: ignore[arg-type]
        if problem is None:
            if kind == "png":  # PNG: no fast decoder to try; Pillow validates the whole stream
                to_rgb(img)
            return Prepared(data, kind, "original", None, w, h)  # type: ignore[arg-type]
        obstacle = problem
    rgb = to_rgb(img)
    if reencode:
        if resize:
            scale = max_side / max(rgb.size)  # type: ignore[operator]
            size = (max(1, round(rgb.size[0] * scale)), max(1, round(rgb.size[1] * scale)))
            rgb = rgb.resize(size, Image.LANCZOS, reducing_gap=3.0)
        q = quality if quality is not None else 90
        why = f"downscaled to longer side {max_side}" if resize else f"re-encoded at quality {q}"
        return Prepared(_encode(rgb, "jpeg", q), "jpeg", "reencoded", why, *rgb.size)
    if kind == "jpeg":
        out = _encode(rgb, "jpeg", NORMALISED_JPEG_QUALITY, subsampling=0)
        return Prepared(out, "jpeg", "normalised", obstacle, *rgb.size)
    return Prepared(_encode(rgb, "png", 0), "png", "normalised", obstacle, *rgb.size)


def prepare_file(path: str, options: dict) -> tuple:
    """Worker entry point: read and prepare one file.

    Returns:
        ``("ok", data, encoding, stored_as, reason)`` or ``("bad", reason)``.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return ("bad", "file not found")
    except IsADirectoryError:
        return ("bad", "is a directory, not a file")
    except PermissionError:
        return ("bad", "permission denied")
    except OSError as exc:
        return ("bad", f"cannot read: {exc}")
    try:
        p = prepare(data, **options)
    except BadImage as exc:
        return ("bad", str(exc))
    return ("ok", p.data, p.encoding, p.stored_as, p.reason)


def sample_error(store: object, index: int, relpath: str | None, exc: BaseException) -> CorruptSampleError:
    """The error for sample ``index`` of ``store`` failing to decode."""
    name = f" ({relpath})" if relpath else ""
    reason = str(exc) if isinstance(exc, BadImage) else f"{type(exc).__name__}: {exc}"
    return CorruptSampleError(
        f"{store}: sample {index}{name} failed to decode: {reason}\n"
        f"HINT: run `fastload verify {store}` to list every bad sample; on_error='skip' "
        "skips bad samples instead of raising.",
        index=index, relpath=relpath,
    )
