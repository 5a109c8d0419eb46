"""Bytes → pixels on the CPU: the fast path and its fallback.

Owns: turning stored bytes into an HWC ``uint8`` RGB array or a PIL image, with the JPEG
fast path (libjpeg-turbo through ``simplejpeg``, with DCT-domain downscaling by 1/2, 1/4
or 1/8 when the caller says how small the result may be) and the reference decoder
(``policy.py``: Pillow, EXIF orientation, 16-bit, CMYK, alpha, bombs) for every other
format and for any JPEG the fast decoder refuses. Failures raise ``BadImage``; readers
turn it into ``CorruptSampleError`` naming the sample (``policy.sample_error``).

Why simplejpeg: it is libjpeg-turbo's TurboJPEG API in a self-contained wheel, faster than
Pillow for a full decode, and it exposes libjpeg-turbo's scaled decode, which Pillow's
``draft`` only offers at 1/2 and below and ``torchvision.io.decode_jpeg`` not at all. Only
the power-of-two scales are used: libjpeg-turbo's SIMD IDCT covers them, and the other
eighths were slower than a full decode. ``fastload bench decode`` times simplejpeg against
Pillow and region against full decode; its figures are in docs/loader.md ("The fast CPU
path") and docs/benchmarks.md.

Region decode (``decode_rgb_region``): a random-resized crop keeps about half of the
image on average; libjpeg-turbo can skip the scanlines and columns outside it. No
pure-Python binding exposes that except NVIDIA's nvImageCodec, whose CPU backend is
libjpeg-turbo with region support; it is installed with the ``dali`` extra (or alone:
``pip install nvidia-nvimgcodec-cu13``) and runs without a GPU. When it imports, JPEG
regions are decoded with it (bit-identical to cropping simplejpeg's full decode, and
faster for a region: the ``region`` row of ``fastload bench decode``); otherwise the full
image is decoded and sliced.
``jpeg_backend()`` says which is in use.

Where the package was built with its C extension (``fastload/image/_jpeg.c``, on the system's
libjpeg-turbo; ``setup.py``), JPEG regions are decoded with that instead: libjpeg-turbo called
directly, without nvImageCodec's framework and its copy of the decoded rows, and a crop can be decoded
from a DCT-scaled image (``decode_jpeg_scaled_region``). The same pixels as a full decode, cropped;
nvImageCodec took 1.12x its time on real photos' crops (``fastload bench decode``, docs/loader.md).
A JPEG it refuses (any libjpeg error or warning, a CMYK one, one over the decompression-bomb limit, one
whose bytes do not end with its end-of-image marker) is decoded as before, which names a problem.

Threads: every function here may be called from many threads at once. simplejpeg and
Pillow keep no shared decoder state; nvImageCodec's decoder is not safe to share, so each
thread gets its own (``threading.local``). A region decode that nvImageCodec cannot do
falls back to a full decode and is counted (``fallback_counts()``, shown by ``doctor``).

Raw records (``convert --encoding raw|auto``, a binary PPM header + HWC pixels) are not
decoded at all: the pixels are copied out of the record (only the crop region, for a
region decode).

Must not: apply augmentation (``transforms.py``) or know about batches.
"""

from __future__ import annotations

import logging
import math
import os
import threading

import numpy as np
from PIL import Image

from fastload.image.policy import (DEFAULT_MAX_PIXELS, check_pixels, decode_reference, decode_rgb, is_jpeg,
                                   open_image, raw_header, sniff)
from fastload.marks import timed

__all__ = ["decode_rgb_fast", "decode_rgb_region", "decode_jpeg_scaled_region", "decode_pil", "image_size",
           "jpeg_backend", "region_backends", "fallback_counts", "jpeg_scale"]

log = logging.getLogger("fastload")

_SCALES = (8, 4, 2)  # denominators of the DCT scales tried, smallest image first
# nvImageCodec decoders are not safe to share between threads (two threads on one decoder
# returned empty images and corrupted the heap), so each thread makes its own; the pid
# check drops a decoder inherited through fork.
_LOCAL = threading.local()
_FALLBACKS = {"region": 0}  # region decodes that fell back to a full decode (counted, not locked: approximate)


def _simplejpeg():
    import simplejpeg

    return simplejpeg


try:  # the compiled region decoder, None where the package was installed without it
    from fastload.image import _jpeg as _TURBO
except Exception:  # not built, or a build this interpreter refuses: the other decoders
    _TURBO = None


def _turbo_region(data: bytes, top: int, left: int, height: int, width: int, scale: int) -> np.ndarray | None:
    """The region decoded by the compiled decoder, or None where it is not built or refuses these bytes."""
    if _TURBO is None:
        return None
    out = np.empty((height, width, 3), dtype=np.uint8)
    try:  # an image over the bomb limit is refused before anything is allocated for it: the fallback names it
        _TURBO.decode_region(data, top, left, height, width, scale, DEFAULT_MAX_PIXELS, out)
    except (ValueError, OverflowError):
        return None
    return out


def _region_decoder():
    """This thread's nvImageCodec CPU decoder, or None when nvImageCodec is not installed."""
    pid = os.getpid()
    if getattr(_LOCAL, "pid", None) != pid:
        _LOCAL.pid, _LOCAL.decoder = pid, _make_region_decoder()
    return _LOCAL.decoder


def _make_region_decoder():
    try:
        from nvidia import nvimgcodec as nv

        dec = nv.Decoder(device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
                         backends=[nv.Backend(nv.BackendKind.CPU_ONLY)])
        params = nv.DecodeParams(color_spec=nv.ColorSpec.SRGB, apply_exif_orientation=False)
        return nv, dec, params
    except Exception:  # not installed, or unusable here: slice a full decode instead
        return None


def _raw_view(data: bytes) -> np.ndarray | None:
    """A read-only HWC view of a raw record's pixels, or None when ``data`` is not one."""
    raw = raw_header(data) if data[:2] == b"P6" else None
    if raw is None:
        return None
    h, w, off = raw
    return np.frombuffer(data, dtype=np.uint8, count=3 * h * w, offset=off).reshape(h, w, 3)


def fallback_counts() -> dict[str, int]:
    """How often, in this process, a region decode fell back to decoding the whole image."""
    return dict(_FALLBACKS)


def region_backends() -> list[str]:
    """The JPEG region decoders usable in this process, the one used first: ``"libjpeg-turbo"`` (the compiled
    one), ``"nvimgcodec-cpu"``."""
    return [name for name, there in (("libjpeg-turbo", _TURBO is not None),
                                     ("nvimgcodec-cpu", _region_decoder() is not None)) if there]


def jpeg_backend() -> str:
    """How JPEG regions are decoded in this process: ``"libjpeg-turbo"`` (the compiled region decoder),
    ``"nvimgcodec-cpu"`` or ``"simplejpeg"`` (a full decode, sliced)."""
    return (region_backends() or ["simplejpeg"])[0]


def jpeg_scale(height: int, width: int, min_height: int, min_width: int) -> int:
    """The denominator of the smallest DCT scale (1/8, 1/4, 1/2) at which a ``height`` x ``width`` JPEG is still
    at least ``min_height`` x ``min_width`` (``ceil(height / scale)`` x ...), else 1: what ``decode_rgb_fast``
    decodes at."""
    for d in _SCALES:
        if math.ceil(height / d) >= min_height and math.ceil(width / d) >= min_width:
            return d
    return 1


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
    elif kind == "pnm":
        raw = raw_header(data)
        if raw is not None:
            return raw[0], raw[1]
    img = open_image(data)
    return img.height, img.width


@timed("decode")
def decode_rgb_fast(data: bytes, *, min_height: int = 0, min_width: int = 0,
                    size: tuple[int, int] | None = None) -> np.ndarray:
    """Decode to an HWC uint8 RGB array, at least ``min_height`` × ``min_width`` when possible.

    A JPEG is decoded at the smallest scale of 1/8, 1/4 or 1/2 whose size still covers
    the minimums (full size when none does or none are given); the array is then smaller
    than the image, by ``scale = array.shape[0] / image height``. ``size`` is the
    ``image_size(data)`` the caller already has, to skip parsing the header twice.

    Raises:
        BadImage: undecodable bytes (the caller turns it into ``CorruptSampleError``).
    """
    if is_jpeg(data):
        sj = _simplejpeg()
        try:
            h, w = size if size is not None else sj.decode_jpeg_header(data)[:2]
            check_pixels(w, h)
            d = jpeg_scale(h, w, min_height, min_width) if min_height or min_width else 1
            if d > 1:
                return sj.decode_jpeg(data, colorspace="RGB", min_height=math.ceil(h / d),
                                      min_width=math.ceil(w / d), min_factor=d)
            return sj.decode_jpeg(data, colorspace="RGB")
        except ValueError:
            pass  # refused by libjpeg-turbo's strict API: let Pillow decide (and name the problem)
    view = _raw_view(data)
    if view is not None:  # raw pixels: nothing to decode (a copy: the store's bytes are read-only)
        return view.copy()
    return decode_rgb(data)


@timed("decode")
def decode_rgb_region(data: bytes, top: int, left: int, height: int, width: int, *,
                      backend: str | None = None) -> np.ndarray:
    """The ``height`` × ``width`` region at (``top``, ``left``) of the image, HWC uint8 RGB.

    Decodes only that region of a JPEG with the compiled decoder, else nvImageCodec, when
    installed; otherwise (and for other formats, or a JPEG they refuse) decodes everything and
    slices. ``backend`` (a ``jpeg_backend()`` name): that one alone before the full decode, to
    compare them (``fastload bench decode``).

    Raises:
        BadImage: undecodable bytes.
    """
    jpeg = is_jpeg(data)
    if jpeg and backend in (None, "libjpeg-turbo"):
        got = _turbo_region(data, top, left, height, width, 1)
        if got is not None:
            return got
    nv = _region_decoder() if jpeg and backend in (None, "nvimgcodec-cpu") else None
    if nv is not None:
        mod, dec, params = nv
        try:
            full = mod.CodeStream(data)
            stream = None if full.height * full.width > DEFAULT_MAX_PIXELS else full.get_sub_code_stream(
                region=mod.Region(top, left, top + height, left + width))
            img = None if stream is None else dec.decode(stream, params=params)
        except Exception:
            img = None
        if img is not None:
            arr = np.asarray(img.cpu())
            if arr.shape == (height, width, 3):
                return arr
        _FALLBACKS["region"] += 1
        if _FALLBACKS["region"] == 1:
            log.debug("nvImageCodec region decode failed; decoding the whole image instead (counted in "
                      "fastload.image.fast.fallback_counts())")
    view = _raw_view(data)
    if view is not None:  # raw pixels: copy only the region (a copy even when it is the whole image: the
        return view[top:top + height, left:left + width].copy()  # view is read-only, torch warns on it)
    return decode_rgb_fast(data)[top:top + height, left:left + width]


@timed("decode")
def decode_jpeg_scaled_region(data: bytes, top: int, left: int, height: int, width: int,
                              scale: int) -> np.ndarray | None:
    """The ``height`` × ``width`` region at (``top``, ``left``) of the JPEG ``data`` decoded at 1/``scale`` (2, 4
    or 8: ``ceil(image height / scale)`` x ..., what ``decode_rgb_fast`` decodes at ``jpeg_scale``), HWC uint8
    RGB; None where the compiled decoder is not built, ``data`` is not a JPEG, or the decoder refuses it: decode
    it with ``decode_rgb_fast`` then, which names a problem."""
    return _turbo_region(data, top, left, height, width, scale) if is_jpeg(data) else None


@timed("decode")
def decode_pil(data: bytes) -> Image.Image:
    """Reference decode to a PIL RGB image, exactly what ``ImageFolder`` + EXIF would give."""
    return decode_reference(data)
