"""Bytes → pixels on the CPU: the fast path and its fallback.

Owns: turning stored bytes into an HWC ``uint8`` RGB array or a PIL image, with the JPEG
fast path (libjpeg-turbo through ``simplejpeg``, with DCT-domain downscaling by 1/2, 1/4
or 1/8 when the caller says how small the result may be) and the reference decoder
(``pack.normalize``: Pillow, EXIF orientation, 16-bit, CMYK, alpha, bombs) for every other
format and for any JPEG the fast decoder refuses. Failures raise ``CorruptSampleError``
naming the sample when the caller gives its name.

Why simplejpeg: it is libjpeg-turbo's TurboJPEG API in a self-contained wheel. On this
project's 2-core reference machine it decodes an ImageNet-sized JPEG in ~0.9 ms against
Pillow's ~1.2 ms, and it exposes libjpeg-turbo's scaled decode, which Pillow's ``draft``
only offers at 1/2 and below and ``torchvision.io.decode_jpeg`` not at all. Only the
power-of-two scales are used: libjpeg-turbo's SIMD IDCT covers them, and the other
eighths measured slower than a full decode.

Must not: apply augmentation (``transforms.py``) or know about batches.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from fastload.errors import CorruptSampleError
from fastload.pack.normalize import BadImage, decode_rgb, open_image, sniff, to_rgb

__all__ = ["decode_rgb_fast", "decode_pil", "image_size", "corrupt"]

_SCALES = (8, 4, 2)  # denominators of the DCT scales tried, smallest image first


def _simplejpeg():
    import simplejpeg

    return simplejpeg


def image_size(data: bytes) -> tuple[int, int]:
    """``(height, width)`` of encoded ``data`` from its header, without decoding."""
    kind = sniff(data)
    if kind == "jpeg":
        try:
            h, w, _, _ = _simplejpeg().decode_jpeg_header(data)
            return h, w
        except Exception:
            pass
    elif kind == "png" and len(data) >= 24:
        return int.from_bytes(data[20:24], "big"), int.from_bytes(data[16:20], "big")
    img = open_image(data)
    return img.height, img.width


def decode_rgb_fast(data: bytes, *, min_height: int = 0, min_width: int = 0) -> np.ndarray:
    """Decode to an HWC uint8 RGB array, at least ``min_height`` × ``min_width`` when possible.

    A JPEG is decoded at the smallest scale of 1/8, 1/4 or 1/2 whose size still covers
    the minimums (full size when none does or none are given); the array is then smaller
    than the image, by ``scale = array.shape[0] / image height``.

    Raises:
        BadImage: undecodable bytes (the caller turns it into ``CorruptSampleError``).
    """
    if sniff(data) == "jpeg":
        sj = _simplejpeg()
        try:
            if min_height or min_width:
                h, w, _, _ = sj.decode_jpeg_header(data)
                for d in _SCALES:
                    if math.ceil(h / d) >= min_height and math.ceil(w / d) >= min_width:
                        return sj.decode_jpeg(data, colorspace="RGB", min_height=math.ceil(h / d),
                                              min_width=math.ceil(w / d), min_factor=d)
            return sj.decode_jpeg(data, colorspace="RGB")
        except ValueError:
            pass  # refused by libjpeg-turbo's strict API: let Pillow decide (and name the problem)
    return decode_rgb(data)


def decode_pil(data: bytes) -> Image.Image:
    """Reference decode to a PIL RGB image, exactly what ``ImageFolder`` + EXIF would give."""
    return to_rgb(open_image(data))


def corrupt(store: object, index: int, relpath: str | None, exc: BaseException) -> CorruptSampleError:
    """The error for sample ``index`` of ``store`` failing to decode."""
    name = f" ({relpath})" if relpath else ""
    reason = str(exc) if isinstance(exc, BadImage) else f"{type(exc).__name__}: {exc}"
    return CorruptSampleError(
        f"{store}: sample {index}{name} failed to decode: {reason}\n"
        f"HINT: run `fastload verify {store}` to list every bad sample; on_error='skip' "
        "skips bad samples instead of raising.",
        index=index, relpath=relpath,
    )
