"""``fastload bench encode``: how to store non-JPEG sources, measured (size, load time, fidelity).

Owns: the measurement behind ``image.policy``'s choice of re-encoding for non-JPEG photo
sources. Every image of a folder (any format; the first N) is decoded once with the
reference decode (what a user sees), then encoded with each candidate:

* ``png`` — lossless PNG, zlib level 3: what ``convert --lossless`` writes;
* ``webp-lossless`` — lossless WebP (method 1; higher methods encode far slower for a few
  per cent of size);
* ``jpeg-q95-444`` — JPEG quality 95, no chroma subsampling: what ``convert`` writes by default;
* ``jpeg-q90-420`` — JPEG quality 90, 4:2:0: what ``--max-side``/``--quality`` re-encodes write.

For each: bits per pixel, encode milliseconds per megapixel (a one-off cost at conversion),
the time fastload's train preset (``train_transform(size).from_bytes``: the work a loader
worker does per sample) takes per image on one thread, and the PSNR against the reference
pixels (min and median). Timing is in interleaved rounds with the order rotated, the median
of the rounds reported with its spread; ratios are against ``png``.

Must not: assert on timings.
"""

from __future__ import annotations

import io
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fastload.bench.decode import DecodeBenchOptions

__all__ = ["EncodeBenchOptions", "EncodeBench", "bench_encode", "CANDIDATES"]

CANDIDATES = ("png", "webp-lossless", "jpeg-q95-444", "jpeg-q90-420")


@dataclass(frozen=True, kw_only=True)
class EncodeBenchOptions(DecodeBenchOptions):
    """``images``: the first N image files under the folder; ``rounds``: interleaved timing
    rounds; ``size``: the train preset's crop size (validated as ``bench decode``'s)."""

    images: int = 24
    rounds: int = 3


@dataclass
class Candidate:
    name: str
    bits_per_pixel: float = 0.0
    encode_ms_per_mp: float = 0.0
    preset_ms: float = 0.0
    rounds: list[float] = field(default_factory=list)
    psnr_min: float = 0.0
    psnr_median: float = 0.0


@dataclass
class EncodeBench:
    options: EncodeBenchOptions
    images: int
    formats: dict[str, int]
    megapixels_mean: float
    candidates: dict[str, Candidate]
    environment: dict

    def table(self) -> str:
        o = self.options
        fmts = ", ".join(f"{k} {v}" for k, v in sorted(self.formats.items()))
        lines = [f"{self.images} images ({fmts}; {self.megapixels_mean:.2f} MP mean), train preset at {o.size} px on "
                 f"one thread, median of {o.rounds} interleaved rounds",
                 f"{'stored as':<15}{'bits/px':>8}{'size vs png':>12}{'encode ms/MP':>14}{'preset ms':>11}"
                 f"{'rounds (min-max)':>18}{'vs png':>8}{'PSNR min/median dB':>20}"]
        png = self.candidates["png"]
        for c in self.candidates.values():
            psnr = "exact" if c.psnr_min >= 100 else f"{c.psnr_min:.1f} / {c.psnr_median:.1f}"
            lines.append(f"{c.name:<15}{c.bits_per_pixel:>8.2f}{c.bits_per_pixel / png.bits_per_pixel:>11.2f}x"
                         f"{c.encode_ms_per_mp:>14.1f}{c.preset_ms:>11.2f}"
                         f"{f'{min(c.rounds):.2f}-{max(c.rounds):.2f}':>18}"
                         f"{png.preset_ms / c.preset_ms:>7.2f}x{psnr:>20}")
        lines.append("vs png: how many times faster the train preset loads that encoding than lossless PNG")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"options": asdict(self.options), "images": self.images, "formats": self.formats,
                "megapixels_mean": self.megapixels_mean, "environment": self.environment,
                "candidates": {k: asdict(v) for k, v in self.candidates.items()}}


def _encode(img, name: str) -> bytes:
    buf = io.BytesIO()
    if name == "png":
        img.save(buf, "PNG", compress_level=3)
    elif name == "webp-lossless":
        img.save(buf, "WEBP", lossless=True, quality=100, method=1)
    elif name == "jpeg-q95-444":
        img.save(buf, "JPEG", quality=95, subsampling=0)
    else:
        img.save(buf, "JPEG", quality=90, subsampling=2)
    return buf.getvalue()


def bench_encode(folder: str | Path, options: EncodeBenchOptions = EncodeBenchOptions()) -> EncodeBench:
    """Encode the first ``options.images`` images under ``folder`` each way and measure them.

    Raises:
        SourceError: no readable image under ``folder``.
    """
    import numpy as np

    from fastload.errors import SourceError
    from fastload.image.formats import BadImage, sniff
    from fastload.image.policy import decode_reference, psnr
    from fastload.load.transforms import train_transform
    from fastload.measure.env import environment
    from fastload.measure.rounds import interleave
    from fastload.measure.timing import one_torch_thread, preset_ms_per_image
    from fastload.pack.sources import IMG_EXTENSIONS

    files = sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in IMG_EXTENSIONS and p.is_file())
    refs, formats = [], {}
    for p in files:
        data = p.read_bytes()
        try:
            refs.append(decode_reference(data))
        except BadImage:
            continue  # a damaged file is convert's business, not this measurement's
        kind = sniff(data) or p.suffix.lower()
        formats[kind] = formats.get(kind, 0) + 1
        if len(refs) == options.images:
            break
    if not refs:
        raise SourceError(f"{folder}: no readable image files to measure.")
    pixels = sum(r.width * r.height for r in refs)
    results, blobs = {}, {}
    for name in CANDIDATES:
        t0 = time.perf_counter()
        blobs[name] = [_encode(r, name) for r in refs]
        seconds = time.perf_counter() - t0
        scores = [psnr(np.asarray(r), np.asarray(decode_reference(b))) for r, b in zip(refs, blobs[name])]
        results[name] = Candidate(name, bits_per_pixel=8 * sum(map(len, blobs[name])) / pixels,
                                  encode_ms_per_mp=seconds * 1e3 / (pixels / 1e6),
                                  psnr_min=min(scores), psnr_median=statistics.median(scores))
    transform = train_transform(options.size)
    with one_torch_thread():
        for name in CANDIDATES:  # warm-up: first calls load libraries and allocate
            preset_ms_per_image(transform, blobs[name][:1], 0)
        # the same seed within a round: the same crops for every candidate
        arms = interleave(list(CANDIDATES), options.rounds,
                          lambda name, r: preset_ms_per_image(transform, blobs[name], options.seed + r))
    for name, c in results.items():
        c.rounds = arms[name].values
        c.preset_ms = arms[name].median()
    return EncodeBench(options, len(refs), formats, pixels / len(refs) / 1e6, results, environment())
