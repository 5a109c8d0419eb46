"""``fastload bench decode``: what each piece of the fast CPU path costs per image, one core.

Owns: timing, on one thread and in interleaved rounds, the single operations the "fast CPU path"
section of docs/loader.md compares, over the JPEGs of one folder with the same
random-resized-crop boxes (fixed seed) for every method:

* ``region`` — only the crop box is decoded (``image.fast.decode_rgb_region``: the compiled
  libjpeg-turbo decoder where fastload was built with it, else nvImageCodec), and ``region
  nvimgcodec`` — nvImageCodec's where both are there, against ``full+crop`` — simplejpeg decodes
  the whole image, then the box is sliced;
* ``simplejpeg`` against ``pillow`` — a full decode to RGB pixels;
* ``resize torch`` — torchvision's antialiased bilinear ``uint8`` kernel on the
  channels-last view (what the presets call), against ``resize pillow`` — PIL bilinear
  (and ``resize opencv`` — ``INTER_AREA`` — when ``cv2`` is importable), each from the
  decoded crop to the output side;
* ``preset`` — the whole ``train_transform(size).from_bytes``, against ``torchvision`` —
  PIL decode + ``RandomResizedCrop`` + flip + ``PILToTensor`` (both end in ``uint8`` CHW).

Each figure is the median over rounds of the mean milliseconds per image; the spread is
the lowest and highest round. A method that cannot run here is reported skipped with
the reason.

Must not: assert on timings.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fastload.image import DEFAULT_SIZE

__all__ = ["DecodeBench", "DecodeBenchOptions", "bench_decode"]

#: (row, what it is compared with) in print order.
PAIRS = (("region", "full+crop"), ("region", "region nvimgcodec"), ("simplejpeg", "pillow"),
         ("resize torch", "resize pillow"), ("resize torch", "resize opencv"), ("preset", "torchvision"),
         ("crc32", "preset"))


@dataclass(frozen=True, kw_only=True)
class DecodeBenchOptions:
    """``images``: JPEGs used (the first N of the folder); ``rounds``: interleaved rounds;
    ``size``: output side of the crop."""

    images: int = 200
    rounds: int = 5
    size: int = DEFAULT_SIZE
    seed: int = 0

    def __post_init__(self) -> None:
        if self.images < 1 or self.rounds < 1 or self.size < 8:
            raise ValueError("images >= 1, rounds >= 1 and size >= 8 are required")


@dataclass
class MethodResult:
    name: str
    ms_per_image: float | None = None
    rounds: list[float] = field(default_factory=list)
    skipped: str | None = None


@dataclass
class DecodeBench:
    options: DecodeBenchOptions
    images: int
    megapixels_mean: float
    results: dict[str, MethodResult]
    environment: dict

    def table(self) -> str:
        o = self.options
        lines = [f"{self.images} JPEGs ({self.megapixels_mean:.2f} MP mean), one thread, {o.size}px crops, median "
                 f"of {o.rounds} interleaved rounds",
                 f"{'method':<16}{'ms/image':>10}{'rounds (min-max)':>20}   {'vs':<18}{'ms/image':>10}{'ratio':>8}"]
        for a, b in PAIRS:
            ra, rb = self.results.get(a), self.results.get(b)
            if ra is None or rb is None:
                continue
            if rb.ms_per_image is None or ra.ms_per_image is None:
                why = rb.skipped or ra.skipped
                lines.append(f"{a:<16}{_ms(ra):>10}{_spread(ra):>20}   {b:<18}{'skipped':>10}  {why}")
                continue
            lines.append(f"{a:<16}{_ms(ra):>10}{_spread(ra):>20}   {b:<18}{_ms(rb):>10}"
                         f"{rb.ms_per_image / ra.ms_per_image:>7.2f}x")
        lines.append("ratio: the second method's time over the first's (above 1: the first is faster)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"options": asdict(self.options), "images": self.images, "megapixels_mean": self.megapixels_mean,
                "environment": self.environment,
                "methods": {k: asdict(v) for k, v in self.results.items()}}


def _ms(r: MethodResult) -> str:
    return f"{r.ms_per_image:.3f}" if r.ms_per_image is not None else "skipped"


def _spread(r: MethodResult) -> str:
    return f"{min(r.rounds):.3f}-{max(r.rounds):.3f}" if r.rounds else "-"


def _methods(blobs: list[bytes], boxes: list[tuple[int, int, int, int]], size: int
             ) -> dict[str, Callable[[int], object] | str]:
    """Each method as ``f(k)`` working on image ``k``, or the reason it cannot run."""
    import io
    import zlib

    import numpy as np
    import torch
    from PIL import Image

    from fastload.image.fast import decode_rgb_fast, decode_rgb_region, jpeg_backend, region_backends
    from fastload.load.transforms import train_transform

    crops = [np.ascontiguousarray(decode_rgb_fast(b)[t:t + h, le:le + w]) for b, (t, le, h, w) in zip(blobs, boxes)]
    pil_crops = [Image.fromarray(c) for c in crops]
    tf = train_transform(size)

    def region(k: int):
        t, le, h, w = boxes[k]
        return decode_rgb_region(blobs[k], t, le, h, w)

    def region_nvimgcodec(k: int):
        t, le, h, w = boxes[k]
        return decode_rgb_region(blobs[k], t, le, h, w, backend="nvimgcodec-cpu")

    def full_crop(k: int):
        t, le, h, w = boxes[k]
        return decode_rgb_fast(blobs[k])[t:t + h, le:le + w]

    def pillow(k: int):
        with Image.open(io.BytesIO(blobs[k])) as img:
            return np.asarray(img.convert("RGB"))

    def resize_torch(k: int):
        chw = torch.from_numpy(crops[k]).permute(2, 0, 1)  # channels-last view, as the presets pass it
        return torch.nn.functional.interpolate(chw.unsqueeze(0), size=[size, size], mode="bilinear",
                                               align_corners=False, antialias=True)

    def resize_pillow(k: int):
        return pil_crops[k].resize((size, size), Image.BILINEAR)

    import torchvision.transforms as T

    tv = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.PILToTensor()])

    def torchvision_preset(k: int):
        with Image.open(io.BytesIO(blobs[k])) as img:
            return tv(img.convert("RGB"))

    methods: dict[str, Callable[[int], object] | str] = {
        "region": region if jpeg_backend() != "simplejpeg" else
        "region decode needs fastload's compiled decoder (a C compiler and libjpeg headers when it is installed: "
        "apt-get install gcc libjpeg-dev) or nvImageCodec (pip install 'fastload[fast]'); this machine has neither",
        "region nvimgcodec": region_nvimgcodec if region_backends() == ["libjpeg-turbo", "nvimgcodec-cpu"] else
        "times nvImageCodec beside fastload's compiled region decoder; this machine has "
        f"{region_backends() or 'neither'}",
        "full+crop": full_crop,
        "simplejpeg": lambda k: decode_rgb_fast(blobs[k]),
        "pillow": pillow,
        "resize torch": resize_torch,
        "resize pillow": resize_pillow,
        "preset": lambda k: tf.from_bytes(blobs[k]),
        "torchvision": torchvision_preset,
        "crc32": lambda k: zlib.crc32(blobs[k]),  # the checksum every store read verifies
    }
    try:
        import cv2

        methods["resize opencv"] = lambda k: cv2.resize(crops[k], (size, size), interpolation=cv2.INTER_AREA)
    except ImportError:
        methods["resize opencv"] = "OpenCV is not installed (pip install opencv-python-headless)"
    return methods


def bench_decode(folder: str | Path, options: DecodeBenchOptions = DecodeBenchOptions()) -> DecodeBench:
    """Time each method over the first ``options.images`` JPEGs under ``folder``.

    Raises:
        SourceError: no JPEG under ``folder``.
    """
    import torch

    from fastload.errors import SourceError
    from fastload.image.fast import image_size
    from fastload.load.transforms import rrc_params
    from fastload.measure.env import environment
    from fastload.measure.rounds import interleave
    from fastload.measure.timing import one_torch_thread

    files = sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in (".jpg", ".jpeg") and p.is_file())
    if not files:
        raise SourceError(f"{folder}: no .jpg/.jpeg files to time.")
    blobs = [p.read_bytes() for p in files[:options.images]]
    torch.manual_seed(options.seed)
    sizes = [image_size(b) for b in blobs]
    boxes = [rrc_params(h, w) for h, w in sizes]
    with one_torch_thread():
        methods = _methods(blobs, boxes, options.size)
        results = {name: MethodResult(name, skipped=m if isinstance(m, str) else None) for name, m in methods.items()}
        runnable = [name for name, m in methods.items() if not isinstance(m, str)]
        for name in runnable:  # warm-up: first calls load libraries and allocate
            for k in range(min(8, len(blobs))):
                methods[name](k)  # type: ignore[operator]
        def measure(name: str, _round: int) -> float:
            fn = methods[name]
            t0 = time.perf_counter()
            for k in range(len(blobs)):
                fn(k)  # type: ignore[operator]
            return (time.perf_counter() - t0) * 1e3 / len(blobs)

        for name, arm in interleave(runnable, options.rounds, measure).items():
            results[name].rounds = arm.values
            if arm.values:
                results[name].ms_per_image = arm.median()
    mp = sum(h * w for h, w in sizes) / len(sizes) / 1e6
    return DecodeBench(options, len(blobs), mp, results, environment())
