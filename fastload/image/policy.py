"""The image policy: what bytes are stored, and what RGB image any bytes stand for.

Owns: the decompression-bomb limit (``check_pixels``: the one pixel check), the reference
decode (Pillow, strict: the RGB image a user sees), the rule that decides whether a file's
original bytes are stored as-is or canonicalised (``prepare``), and reading source files
safely (``read_source_file``). Beside it: ``formats.py`` recognises bytes (``sniff``,
``is_jpeg``: the one magic-byte check) and ``damage.py`` holds the structural checks that
tell a damaged file from an odd one (``png_damage``, ``jpeg_damage``).

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
* JPEG: decoded by libjpeg-turbo (simplejpeg) in strict mode. A warning about the header
  (stray bytes between segments before the scan, malformed ICC profile markers, scan-header
  fields a sequential decode ignores, an unknown JFIF revision or Adobe transform) is odd,
  once the file decodes without a warning with those set aside. Any warning from the scan data is damage:
  "N extraneous bytes before marker" EOI/RSTn/DHT/SOS (the decoder lost sync, as bit rot
  does), "premature end of data segment" (also when an end marker was appended to a cut
  file), "premature end of JPEG file" (no end marker), bad Huffman codes, wrong restart
  markers, unknown markers. Measured on intact and bit-rotted files by
  ``tools/jpeg_damage_table.py`` (docs/jpeg-damage.md). Limit: a change to the scan data
  that decodes without a warning (to other pixels) cannot be told from an intact file.
* Decompression bombs (over ``max_pixels``), empty files, files Pillow cannot open
  (including 12-bit JPEGs, which Pillow and so ``ImageFolder`` cannot read) are bad.

Store as-is rule. Original bytes are kept only for plain 8-bit RGB or grayscale JPEG
(baseline, extended or progressive Huffman, one frame) without EXIF rotation that pass the
checks above and whose libjpeg-turbo decode equals Pillow's pixel for pixel. Other JPEG
sources are canonicalised: the reference RGB image re-encoded as JPEG quality 95 with 4:4:4
chroma.

Non-JPEG sources (PNG, WebP, TIFF, GIF, BMP, ...) are re-encoded as JPEG quality 95, 4:4:4
(``stored_as`` "reencoded", lossy, its PSNR recorded) unless ``lossless=True``
(``convert --lossless``). Why: a PNG is decoded whole, every epoch, by zlib and Pillow,
while a JPEG gets libjpeg-turbo's DCT-scaled and region decode on the CPU and nvJPEG on the
GPU. ``fastload bench encode`` measures the trade (load speed in the train preset, bytes,
PSNR, encode cost) on any folder; its figures, with the commands that printed them, are in
docs/benchmarks.md ("Which encoding for non-JPEG sources"). With ``lossless=True`` the
old rule holds: non-interlaced 8-bit RGB or grayscale PNGs that pass the checks are stored
as-is and every other non-JPEG source as lossless PNG (bit-exact). Whatever is stored (original,
canonicalised or re-encoded) is decoded again, strictly, before it is accepted; the PSNR of every
lossy write against the pixels it
encodes is returned (``Prepared.psnr``).

Must not: import torch or anything from the rooms above (``store/``, ``pack/``, ``load/``).
"""

from __future__ import annotations

import dataclasses
import errno
import io
import os
import re
import stat
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFile, ImageOps

from fastload.errors import CorruptSampleError
from fastload.image.damage import (DROP_BAD_CHUNKS, bad_crc_chunks, jpeg_damage, png_damage,
                                   png_without_bad_chunks)
from fastload.image.formats import BadImage, encode_raw, is_jpeg, jpeg_frame, raw_header, sniff

__all__ = ["BadImage", "Prepared", "DEFAULT_MAX_PIXELS", "DEFAULT_MAX_FILE_BYTES", "ENCODING_CHOICES",
           "AUTO_RAW_MAX_PIXELS", "LOSSY_REENCODE", "psnr", "is_jpeg", "sniff", "jpeg_frame", "raw_header",
           "encode_raw", "check_pixels", "open_image", "to_rgb", "mode_to_rgb", "decode_reference", "decode_rgb",
           "png_damage", "png_without_bad_chunks", "jpeg_damage", "prepare", "read_source_file", "prepare_file",
           "sample_error"]

#: Pillow's own hard limit (2 × ``Image.MAX_IMAGE_PIXELS``): nothing Pillow accepts is refused.
DEFAULT_MAX_PIXELS = 2 * 89_478_485
#: Files larger than this are not read at conversion (``--max-file-bytes``).
DEFAULT_MAX_FILE_BYTES = 1 << 30
CANONICAL_JPEG_QUALITY = 95
#: How non-JPEG sources are stored unless ``lossless`` (see the module docstring).
LOSSY_REENCODE = f"JPEG q{CANONICAL_JPEG_QUALITY} 4:4:4"
#: PSNR written for a lossy write that came out pixel-exact (JSON has no infinity).
PSNR_EXACT = 100.0
#: libjpeg's limit on either side: larger non-JPEG sources stay lossless PNG.
JPEG_MAX_SIDE = 65500
#: ``--encoding auto`` stores raw pixels for images up to this many pixels (256 x 256), encoded above.
AUTO_RAW_MAX_PIXELS = 256 * 256
ENCODING_CHOICES = ("jpeg", "raw", "auto")

_JPEG_OK_SOF = {0xC0, 0xC1, 0xC2}  # baseline, extended sequential, progressive (Huffman)


@dataclass(frozen=True)
class Prepared:
    """What to store for one source file."""

    data: bytes
    encoding: str  # "jpeg" | "png" | "raw"
    stored_as: str  # "original" | "canonicalised" | "reencoded"
    reason: str | None  # why it was canonicalised / re-encoded
    width: int
    height: int
    psnr: float | None = None  # dB against the pixels encoded, for lossy writes; None when exact
    salvaged: str | None = None  # what was repaired so that Pillow reads it (docs/jpeg-damage.md), else None


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of ``b`` against ``a`` (uint8 pixels), in dB; ``PSNR_EXACT`` if equal.

    Summed in strips of rows in integers: a 100 MP image costs a few MB here, not gigabytes.
    """
    total, rows = 0, max(1, (1 << 20) // max(1, a[0].size))
    for y in range(0, a.shape[0], rows):
        d = a[y:y + rows].astype(np.int32) - b[y:y + rows]
        total += int(np.dot(d.ravel().astype(np.int64), d.ravel()))
    mse = total / a.size
    return PSNR_EXACT if mse == 0 else min(PSNR_EXACT, round(10.0 * float(np.log10(255.0 ** 2 / mse)), 2))


def check_pixels(width: int, height: int, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
    """Refuse decompression bombs before any decoder allocates for them."""
    if width <= 0 or height <= 0:
        raise BadImage(f"image has zero size {width}x{height}")
    if width * height > max_pixels:
        raise BadImage(
            f"decompression bomb: {width}x{height} = {width * height:,} pixels is over the limit of "
            f"{max_pixels:,} (raise it with --max-pixels if the image is genuine)"
        )


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
        said = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", str(exc))  # an address says nothing
        raise BadImage(f"{what}: {said}") from None
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
    return mode_to_rgb(img)


def mode_to_rgb(img: Image.Image) -> Image.Image:
    """A loaded image of any mode → the 8-bit RGB image the rule says (16-bit: the high byte; alpha and
    ``tRNS`` dropped; ``F`` as in the module docstring), without EXIF orientation. The presets use it
    on PIL images they are given, so those follow the same rule as the bytes they decode.

    Raises:
        BadImage: the pixels cannot be converted at all.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
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


def _accept(data: bytes, encoding: str, rgb: np.ndarray | None, size: tuple[int, int]) -> float | None:
    """Decode what is about to be stored, strictly, with the decoder the loaders use on it.

    Returns the PSNR of a JPEG against ``rgb`` (the pixels encoded), None for a PNG (exact)."""
    if encoding == "jpeg":
        damage, fast = jpeg_damage(data)
        if damage or fast is None or fast.shape[:2] != (size[1], size[0]):
            raise BadImage(f"internal error: the re-encoded JPEG does not decode cleanly ({damage})")
        return psnr(rgb, fast) if rgb is not None else None
    png_damage(data)
    back = np.asarray(decode_reference(data))
    if rgb is not None and not np.array_equal(back, rgb):
        raise BadImage("internal error: the lossless PNG re-encode does not decode to the same pixels")
    return None


def prepare(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS, max_side: int | None = None,
            quality: int | None = None, encoding: str = "jpeg", lossless: bool = False) -> Prepared:
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
        lossless: keep non-JPEG sources pixel-exact (original PNG bytes where the rule
            allows, lossless PNG otherwise) instead of re-encoding them as JPEG q95 4:4:4.

    Raises:
        BadImage: the file is damaged or not a usable image; the message says why.
    """
    kind = sniff(data)
    odd: list[str] = []
    source, salvaged = data, None
    if kind == "png":
        if data[12:16] == b"IHDR":  # the bomb limit before the image stream is inflated
            check_pixels(int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big"), max_pixels)
        odd = png_damage(data)
        if DROP_BAD_CHUNKS in odd:  # Pillow refuses those chunks; the pixels do not need them
            odd.remove(DROP_BAD_CHUNKS)
            source = png_without_bad_chunks(data)
            try:
                open_image(data, max_pixels=max_pixels)
            except BadImage:  # Pillow (so ImageFolder and serve) refuses the file as it is
                salvaged = (f"left out ancillary PNG chunk(s) {', '.join(bad_crc_chunks(data))} with a bad CRC, for "
                            "which Pillow cannot open the file; the image data's own checks (zlib adler32, length, "
                            "row filters) passed")
    out = _decide(data, kind, source, odd, max_pixels=max_pixels, max_side=max_side, quality=quality,
                  encoding=encoding, lossless=lossless)
    return dataclasses.replace(out, salvaged=salvaged) if salvaged else out


def _decide(data: bytes, kind: str | None, source: bytes, odd: list[str], *, max_pixels: int, max_side: int | None,
            quality: int | None, encoding: str, lossless: bool) -> Prepared:
    """``prepare`` once a PNG's structure is checked: ``source`` is what Pillow reads (``data``, or
    the PNG without its bad-CRC ancillary chunks)."""
    fast = None
    img = open_image(source, max_pixels=max_pixels)
    if kind == "jpeg":  # after open_image: its bomb check comes before libjpeg-turbo allocates
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
    reencode = resize or (quality is not None and max_side is None and max(w, h) <= JPEG_MAX_SIDE)
    if obstacle is None and not reencode and (kind == "jpeg" or lossless):
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
        fidelity = _accept(out, "jpeg", np.asarray(out_img), out_img.size)
        return Prepared(out, "jpeg", "reencoded", why, *out_img.size, psnr=fidelity)
    if kind == "jpeg" or (not lossless and max(w, h) <= JPEG_MAX_SIDE):
        # JPEG sources canonicalised; other sources as JPEG unless lossless: both as JPEG q95 4:4:4
        out = _encode(rgb_img, "jpeg", CANONICAL_JPEG_QUALITY, subsampling=0)
        fidelity = _accept(out, "jpeg", rgb, rgb_img.size)
        if kind == "jpeg":
            return Prepared(out, "jpeg", "canonicalised", obstacle, w, h, psnr=fidelity)
        what = (img.format or kind or "non-JPEG").upper()
        return Prepared(out, "jpeg", "reencoded", f"{what} source stored as {LOSSY_REENCODE} "
                        "(lossy; --lossless keeps it exact)", w, h, psnr=fidelity)
    if obstacle is None:  # lossy by default, but over JPEG's size limit: the original stays
        return Prepared(data, kind, "original", None, w, h)  # type: ignore[arg-type]
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
        if exc.errno in (errno.ELOOP, errno.ENAMETOOLONG, errno.ENOTDIR, errno.ENXIO):
            raise BadImage(f"cannot read: {exc}") from None  # what the tree is, every time
        raise  # EIO, ESTALE, ETIMEDOUT...: the file exists but could not be read now, which is not a bad
        # image; conversion fails (and is rerun) rather than skip it for good
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
        ``("ok", data, encoding, stored_as, reason, psnr, notes)`` or ``("bad", reason, notes)``;
        ``notes``: ``{"salvaged": what was repaired or None, "warnings": the decoders' warnings}``.
    """
    ImageFile.LOAD_TRUNCATED_IMAGES = False  # strict in every conversion worker, whatever was imported
    opts = dict(options)
    max_bytes = opts.pop("max_file_bytes", DEFAULT_MAX_FILE_BYTES)
    inside = opts.pop("inside", None)
    # Pillow's warnings (corrupt EXIF, malformed MPO, ...) go into the report per file, not to stderr
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            real = os.path.realpath(path)
            if inside is not None and real != os.path.abspath(path) and not _within(real, inside):
                raise BadImage(f"symbolic link to {real}, outside the source; pass --follow-symlinks to read it")
            p = prepare(read_source_file(path, max_bytes=max_bytes), **opts)
        except BadImage as exc:
            return ("bad", str(exc), _notes(caught, None))
        except MemoryError:
            return ("bad", "out of memory while decoding", _notes(caught, None))
    return ("ok", p.data, p.encoding, p.stored_as, p.reason, p.psnr, _notes(caught, p.salvaged))


def _notes(caught: list[warnings.WarningMessage], salvaged: str | None) -> dict:
    """What a worker reports about a file besides the verdict: repairs, and decoder warnings (each once)."""
    said = list(dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught))
    return {"salvaged": salvaged, "warnings": said}


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
