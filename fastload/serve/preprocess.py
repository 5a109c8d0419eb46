"""What happens to one request's bytes before batching, and where the model runs.

Owns: the serving pixel budget (checked from the image header, before any decoding),
the decode through the eval preset with errors turned into ``CorruptSampleError``, giving
freed decode memory back to the OS after big images, the device choice (``"auto"``,
``"cpu"``, ``"cuda"``, ``"cuda:N"``) and the model dtypes.

Must not: batch, queue, or know about HTTP.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

import torch

from fastload.errors import CorruptSampleError
from fastload.load.transforms import is_preset

__all__ = ["SERVE_MAX_PIXELS", "DTYPES", "check_request_pixels", "decode_request", "pick_device"]

log = logging.getLogger("fastload.serve")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# A serving budget well under the decompression-bomb limit (Pillow's 179 MP): decoding a 40 MP
# image takes 120 MB of RGB; a 13000x13000 one 500 MB before any resize.
SERVE_MAX_PIXELS = 40_000_000
_TRIM_PIXELS = 4_000_000  # after decoding an image this big, hand freed memory back to the OS


def _malloc_trim() -> Callable[[], None]:
    """glibc's ``malloc_trim(0)``: return freed heap pages to the OS (a no-op elsewhere).

    Large decode buffers raise glibc's dynamic mmap threshold, so later ones come from
    the heap and stay in RSS after they are freed; trimming after big requests gives
    that memory back (https://man7.org/linux/man-pages/man3/malloc_trim.3.html).
    """
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        return lambda: fn(0)
    except (OSError, AttributeError):
        return lambda: None


_trim = _malloc_trim()


def check_request_pixels(data: bytes, max_pixels: int) -> int:
    """The pixels ``data``'s header declares; refuses more than ``max_pixels`` without decoding.

    Raises:
        CorruptSampleError: not an image, or over the budget (the message says which).
    """
    from fastload.image.fast import image_size
    from fastload.image.policy import BadImage

    try:
        h, w = image_size(data)
    except BadImage as exc:
        raise CorruptSampleError(f"cannot decode the request body as an image: {exc}") from exc
    except Exception as exc:
        raise CorruptSampleError(f"cannot decode the request body as an image: {type(exc).__name__}: "
                                 f"{exc}") from exc
    if h * w > max_pixels:
        raise CorruptSampleError(
            f"the image declares {w}x{h} = {w * h:,} pixels, over this server's budget of {max_pixels:,} "
            "(max_pixels); refused before decoding (a decompression bomb or an image too large to serve)\n"
            "HINT: downscale it before sending, or start the server with a larger --max-pixels")
    return h * w


def decode_request(preprocess: Callable, data: bytes, max_pixels: int) -> torch.Tensor:
    """Check the budget, then ``preprocess`` (its ``from_bytes`` when it has one) → uint8 CHW.

    Raises:
        CorruptSampleError: undecodable bytes or over the pixel budget.
    """
    pixels = check_request_pixels(data, max_pixels)
    try:
        return preprocess.from_bytes(data) if is_preset(preprocess) else preprocess(data)
    except Exception as exc:
        from fastload.image.policy import BadImage

        reason = str(exc) if isinstance(exc, BadImage) else f"{type(exc).__name__}: {exc}"
        raise CorruptSampleError(f"cannot decode the request body as an image: {reason}") from exc
    finally:
        if pixels >= _TRIM_PIXELS:
            _trim()


def pick_device(name: str) -> torch.device:
    """``"auto"`` → a usable CUDA device, else the CPU; an explicit CUDA device must be usable.

    Raises:
        ValueError: an unknown name, or CUDA asked for and absent.
        RuntimeError: the CUDA device asked for is visible but unusable.
    """
    from fastload.system import resolve_device

    if name != "auto" and not str(name).startswith(("cpu", "cuda")):
        raise ValueError(f"Unknown value {name!r} for argument device. Valid values are 'auto', 'cpu', "
                         "'cuda', 'cuda:N'.")
    dev = resolve_device(name, what="device")
    if dev.type == "cuda":
        try:
            torch.zeros(1, device=dev).add_(1)
        except Exception as exc:  # visible but unusable (driver mismatch, busy, out of memory)
            if name != "auto":
                raise RuntimeError(f"device {name!r} is not usable ({exc}); use device='cpu'.") from exc
            log.warning("CUDA is visible but unusable (%s); serving on the CPU", exc)
            dev = torch.device("cpu")
    return dev
