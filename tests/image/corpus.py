"""An adversarial corpus of image files: every way Pillow represents an image, odd-but-valid
files, and damaged ones. Each kind says what conversion must do with it.

``expect``: ``"original"`` (stored byte for byte), ``"canonical"`` (re-encoded to the RGB a
user sees) or ``"skip"`` (reported with a reason matching ``why``).
"""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from helpers import bomb_png, jpeg_bomb, jpeg_bytes, photo, png_bytes, png_chunk

DATA = Path(__file__).parent / "data"


@dataclass(frozen=True)
class Kind:
    name: str  # file name in the corpus (the extension is what a user would have)
    data: bytes
    expect: str
    why: str = ""  # a regex the skip reason must match


def _save(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    if "append_images" in kw:  # Pillow leaves encoder settings on saved images: never reuse them
        kw["append_images"] = [f.copy() for f in kw["append_images"]]
    img.copy().save(buf, fmt, **kw)
    return buf.getvalue()


def _exif_jpeg(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return jpeg_bytes(photo(40, 24, seed=orientation), exif=exif.tobytes())


def _png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    out, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        out.append((data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]))
        pos += 12 + length
    return out


def _png_from(chunks: list[tuple[bytes, bytes]]) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + b"".join(png_chunk(k, v) for k, v in chunks)


def _png_raw(width: int, height: int, rows: bytes, colour: int = 2) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, colour, 0, 0, 0)
    return _png_from([(b"IHDR", ihdr), (b"IDAT", zlib.compress(rows)), (b"IEND", b"")])


def _interlaced(img: Image.Image) -> bytes:
    """An Adam7-interlaced 8-bit RGB PNG (Pillow only writes non-interlaced ones)."""
    arr = np.asarray(img.convert("RGB"))
    h, w = arr.shape[:2]
    raw = b""
    for x0, y0, dx, dy in ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
                           (0, 1, 1, 2)):
        sub = arr[y0::dy, x0::dx]
        if sub.size:
            raw += b"".join(b"\0" + row.tobytes() for row in sub)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 1)
    return _png_from([(b"IHDR", ihdr), (b"IDAT", zlib.compress(raw)), (b"IEND", b"")])


def _damaged_idat(png: bytes) -> bytes:
    """Flip bytes inside the zlib stream, with a CRC that matches the damaged chunk."""
    chunks = _png_chunks(png)
    out = []
    for k, v in chunks:
        if k == b"IDAT":
            b = bytearray(v)
            for off in range(len(b) // 3, len(b) // 3 + 12):
                b[off] ^= 0x5A
            v = bytes(b)
        out.append((k, v))
    return _png_from(out)


def _bad_crc(png: bytes, chunk: bytes) -> bytes:
    data = bytearray(png)
    pos = 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        if data[pos + 4:pos + 8] == chunk:
            data[pos + 8 + length] ^= 0xFF
            return bytes(data)
        pos += 12 + length
    raise ValueError(f"no {chunk} chunk")


def _with_text(png: bytes) -> bytes:
    chunks = _png_chunks(png)
    return _png_from(chunks[:1] + [(b"tEXt", b"Comment\0hello")] + chunks[1:])


def _cut_inside(png: bytes, chunk: bytes, keep: int) -> bytes:
    pos = 8
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos:pos + 4])
        if png[pos + 4:pos + 8] == chunk:
            return png[:pos + 8 + keep]
        pos += 12 + length
    raise ValueError(chunk)


def _exif_png(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return png_bytes(photo(30, 20, seed=7), exif=exif.tobytes())


def _scan_start(jpeg: bytes) -> int:
    i = jpeg.index(b"\xff\xda")
    (length,) = struct.unpack(">H", jpeg[i + 2:i + 4])
    return i + 2 + length


def _corrupt_entropy(jpeg: bytes) -> bytes:
    """Bytes in the scan that libjpeg-turbo reports as corrupt (an invalid marker in the data)."""
    start = _scan_start(jpeg)
    b = bytearray(jpeg)
    mid = start + (len(b) - start) // 2
    b[mid:mid + 2] = b"\xff\x99"  # 0xFF followed by a non-marker byte inside entropy-coded data
    return bytes(b)


def _extraneous(jpeg: bytes) -> bytes:
    """Bytes between the scan data and the end marker: the scan ended before its data did (lost sync)."""
    assert jpeg[-2:] == b"\xff\xd9"
    return jpeg[:-2] + b"\x12\x34\x56" + jpeg[-2:]


def _padded_header(jpeg: bytes) -> bytes:
    """Stray bytes between two header segments (before the scan): an encoder's padding, pixels intact."""
    i = jpeg.index(b"\xff\xdb")
    return jpeg[:i] + b"\0" * 7 + jpeg[i:]


def _icc_after_sof(gray_jpeg: bytes) -> bytes:
    """ICC profile markers before and after the SOF (a camera's layout): libjpeg-turbo says "bad ICC
    marker", a metadata warning; Pillow and torchvision decode the pixels."""
    body = b"ICC_PROFILE\0\x01\x01" + _icc()
    app2 = b"\xff\xe2" + struct.pack(">H", len(body) + 2) + body
    i = gray_jpeg.index(b"\xff\xc0")
    sof_end = i + 2 + struct.unpack(">H", gray_jpeg[i + 2:i + 4])[0]
    return gray_jpeg[:2] + app2 + gray_jpeg[2:sof_end] + app2 + gray_jpeg[sof_end:]


def _ycck(cmyk_jpeg: bytes) -> bytes:
    """Pillow writes CMYK JPEGs with an Adobe APP14 marker; transform 2 makes the decoder read YCCK."""
    b = bytearray(cmyk_jpeg)
    i = b.index(b"\xff\xee")
    assert b[i + 4:i + 9] == b"Adobe"
    b[i + 15] = 2
    return bytes(b)


def _icc() -> bytes:
    from PIL import ImageCms

    return ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()


def kinds() -> list[Kind]:
    base = photo(48, 32, seed=1)
    good_jpeg = jpeg_bytes(photo(64, 48, seed=2))
    prog = jpeg_bytes(photo(64, 48, seed=3), progressive=True)
    good_png = png_bytes(base)
    frames = [photo(32, 24, seed=s) for s in (10, 11, 12)]
    cmyk = jpeg_bytes(base.convert("CMYK"), quality=92)
    pal = base.convert("P", palette=Image.ADAPTIVE, colors=16)
    pal_trns = pal.copy()
    pal_trns.info["transparency"] = 3
    pal_alpha = pal.copy()
    pal_alpha.info["transparency"] = bytes(range(0, 256, 16))
    la = base.convert("LA")
    rgba = base.convert("RGBA")
    rgba.putalpha(100)
    gray16 = Image.fromarray(np.asarray(base.convert("L")).astype(np.uint16) * 257)
    rgb16_rows = b"".join(b"\0" + np.repeat(np.asarray(base)[y].astype(">u2") * 257, 1).tobytes()
                          for y in range(base.height))
    rgb16 = _png_from([(b"IHDR", struct.pack(">IIBBBBB", base.width, base.height, 16, 2, 0, 0, 0)),
                       (b"IDAT", zlib.compress(rgb16_rows)), (b"IEND", b"")])
    floats = Image.fromarray(np.asarray(base.convert("L"), dtype=np.float32) / 255.0, "F")
    ints = Image.fromarray(np.asarray(base.convert("L"), dtype=np.int32) * 200, "I")
    bad_filter_rows = b"".join(b"\x07" + bytes(np.asarray(base)[y].tobytes()) for y in range(base.height))
    mpo = _save(frames[0], "MPO", save_all=True, append_images=frames[1:2], quality=90)
    return [
        # JPEG stored as they are
        Kind("jpeg/baseline.jpg", good_jpeg, "original"),
        Kind("jpeg/gray.jpg", jpeg_bytes(base.convert("L")), "original"),
        Kind("jpeg/progressive.jpg", prog, "original"),
        Kind("jpeg/subsampling-422.jpg", jpeg_bytes(base, subsampling=1), "original"),
        Kind("jpeg/restart-markers.jpg", (DATA / "restart-markers.jpg").read_bytes(), "original"),
        Kind("jpeg/icc-profile.jpg", jpeg_bytes(base, icc_profile=_icc()), "original"),
        Kind("jpeg/garbage-after-eoi.jpg", good_jpeg + b"trailing garbage" * 4, "original"),
        Kind("jpeg/one-pixel.jpg", jpeg_bytes(photo(1, 1)), "original"),
        Kind("jpeg/one-by-n.jpg", jpeg_bytes(photo(1, 37)), "original"),
        Kind("jpeg/exif-orientation-1.jpg", _exif_jpeg(1), "original"),
        Kind("jpeg/broken-exif.jpg", good_jpeg[:2] + b"\xff\xe1\x00\x10Exif\x00\x00garbage!" + good_jpeg[2:],
             "original"),
        Kind("jpeg/ycbcr-mode.jpg", jpeg_bytes(base.convert("YCbCr")), "original"),
        # JPEG canonicalised
        *[Kind(f"jpeg/exif-orientation-{o}.jpg", _exif_jpeg(o), "canonical") for o in range(2, 9)],
        Kind("jpeg/cmyk.jpg", cmyk, "canonical"),
        Kind("jpeg/ycck.jpg", _ycck(cmyk), "canonical"),
        Kind("jpeg/arithmetic.jpg", (DATA / "arithmetic.jpg").read_bytes(), "canonical"),
        Kind("jpeg/padded-header.jpg", _padded_header(good_jpeg), "canonical"),
        Kind("jpeg/gray-icc-after-sof.jpg", _icc_after_sof(jpeg_bytes(base.convert("L"))), "canonical"),
        Kind("jpeg/mpo-two-frames.jpg", mpo, "canonical"),
        Kind("jpeg/png-named-jpg.jpg", good_png, "original"),
        # JPEG skipped
        Kind("jpeg/truncated-mid-scan.jpg", good_jpeg[:len(good_jpeg) * 2 // 3], "skip", "damaged JPEG|truncated"),
        Kind("jpeg/truncated-then-eoi.jpg", good_jpeg[:len(good_jpeg) * 2 // 3] + b"\xff\xd9", "skip",
             "damaged JPEG"),
        Kind("jpeg/progressive-truncated.jpg", prog[:len(prog) // 2], "skip", "damaged JPEG|truncated"),
        Kind("jpeg/extraneous-bytes-before-eoi.jpg", _extraneous(good_jpeg), "skip", "damaged JPEG.*lost sync"),
        Kind("jpeg/corrupt-entropy.jpg", _corrupt_entropy(good_jpeg), "skip", "damaged JPEG|decode failed"),
        Kind("jpeg/twelve-bit.jpg", (DATA / "twelve-bit.jpg").read_bytes(), "skip", "12-bit JPEG"),
        Kind("jpeg/bomb-header.jpg", jpeg_bomb(), "skip", "decompression bomb"),
        Kind("jpeg/text-named-jpg.jpg", b"not an image at all\n" * 20, "skip", "not an image"),
        Kind("jpeg/empty.jpg", b"", "skip", "empty file"),
        # PNG stored as they are
        Kind("png/rgb.png", good_png, "original"),
        Kind("png/gray.png", png_bytes(base.convert("L")), "original"),
        Kind("png/icc-profile.png", png_bytes(base, icc_profile=_icc()), "original"),
        Kind("png/one-pixel.png", png_bytes(photo(1, 1)), "original"),
        Kind("png/n-by-one.png", png_bytes(photo(41, 1)), "original"),
        # PNG canonicalised
        Kind("png/palette.png", png_bytes(pal), "canonical"),
        Kind("png/palette-trns.png", png_bytes(pal_trns), "canonical"),
        Kind("png/palette-alpha.png", png_bytes(pal_alpha), "canonical"),
        Kind("png/gray-alpha.png", png_bytes(la), "canonical"),
        Kind("png/rgba.png", png_bytes(rgba), "canonical"),
        Kind("png/gray16.png", png_bytes(gray16), "canonical"),
        Kind("png/rgb16.png", rgb16, "canonical"),
        Kind("png/one-bit.png", png_bytes(base.convert("1")), "canonical"),
        Kind("png/interlaced.png", _interlaced(base), "canonical"),
        Kind("png/bad-crc-text.png", _bad_crc(_with_text(good_png), b"tEXt"), "canonical"),
        Kind("png/bad-crc-idat.png", _bad_crc(good_png, b"IDAT"), "canonical"),
        Kind("png/apng.png", _save(frames[0], "PNG", save_all=True, append_images=frames[1:]), "canonical"),
        Kind("png/exif-orientation-6.png", _exif_png(6), "canonical"),
        # PNG skipped
        Kind("png/damaged-idat.png", _damaged_idat(good_png), "skip", "damaged PNG"),
        Kind("png/truncated-in-idat.png", _cut_inside(good_png, b"IDAT", 40), "skip", "damaged PNG|cut short"),
        Kind("png/truncated-in-iend.png", good_png[:-2], "skip", "decode failed|truncated|cut short"),
        Kind("png/bad-filter-bytes.png", _png_raw(base.width, base.height, bad_filter_rows), "skip",
             "bad row filter"),
        Kind("png/bomb-header.png", bomb_png(), "skip", "decompression bomb"),
        # other formats, canonicalised to PNG
        Kind("other/photo.gif", _save(pal, "GIF"), "canonical"),
        Kind("other/animated.gif", _save(frames[0].convert("P"), "GIF", save_all=True,
                                         append_images=[f.convert("P") for f in frames[1:]]), "canonical"),
        Kind("other/lossy.webp", _save(base, "WEBP", quality=80), "canonical"),
        Kind("other/lossless.webp", _save(base, "WEBP", lossless=True), "canonical"),
        Kind("other/animated.webp", _save(frames[0], "WEBP", save_all=True, append_images=frames[1:]), "canonical"),
        Kind("other/photo.tiff", _save(base, "TIFF"), "canonical"),
        Kind("other/multipage.tiff", _save(frames[0], "TIFF", save_all=True, append_images=frames[1:],
                                           compression="tiff_lzw"), "canonical"),
        Kind("other/gray16.tiff", _save(gray16, "TIFF"), "canonical"),
        Kind("other/float.tiff", _save(floats, "TIFF"), "canonical"),
        Kind("other/int32.tiff", _save(ints, "TIFF"), "canonical"),
        Kind("other/photo.bmp", _save(base, "BMP"), "canonical"),
        Kind("other/photo.ppm", _save(base, "PPM"), "canonical"),
    ]


def user_view(data: bytes) -> np.ndarray:
    """What a user sees, written independently of fastload: Pillow, first frame, EXIF applied,
    then the documented rules for 16-bit (high byte) and float (0..1 scaled) samples."""
    if data.startswith(b"\x89PNG"):  # Pillow refuses bad-CRC ancillary chunks: look without them
        from fastload.image.policy import png_without_bad_chunks

        data = png_without_bad_chunks(data)
    import warnings

    with warnings.catch_warnings(), Image.open(io.BytesIO(data)) as img:
        warnings.simplefilter("ignore")
        img.load()
        img = ImageOps.exif_transpose(img)
        if img.mode.startswith("I;16") or (img.mode == "I" and np.asarray(img).max() > 255):
            arr = (np.asarray(img).astype(np.uint32) >> 8).astype(np.uint8)
            img = Image.fromarray(arr, "L")
        elif img.mode == "F":
            arr = np.asarray(img, dtype=np.float32)
            arr = arr * 255 if arr.max() <= 1 else arr
            img = Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), "L")
        return np.asarray(img.convert("RGB"))
