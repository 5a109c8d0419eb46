"""The generated default dataset: a synthetic ImageFolder tree made offline, deterministically.

Owns: generating natural-image-like JPEGs (1/f "pink" noise fields, correlated colour
channels, a few class-specific shapes and sensor-like grain) at ImageNet-like sizes, plus
a few PNGs, in an ImageFolder layout (``root/<class>/<file>``). The same arguments give
the same bytes on every run, so tests, recipes, benchmarks and the README share one
dataset without the network.

Must not: download anything, or depend on torch (it runs in spawn workers and CI setup).

Why not flat colours: JPEG decode time scales with entropy. A flat or smooth image decodes
several times faster than a photograph of the same size and would make every loader look
faster than it is on real data. These images land at roughly 1.5-3 bits per pixel at
quality 90, in the range of ImageNet photographs.
"""

from __future__ import annotations

import io
import os
import zlib
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from fastload.errors import FastloadError
from fastload.system import available_cpus

__all__ = ["DatasetSpec", "DEFAULT_SPEC", "make_dataset", "cache_dir", "default_dataset_dir",
           "ensure_default_dataset"]

_CLASS_NAMES = (
    "aurora", "basalt", "coral", "dune", "ember", "fjord", "glacier", "heath",
    "island", "jungle", "karst", "lagoon", "mesa", "nebula", "oasis", "prairie",
)
_COMPLETE_MARKER = ".fastload-dataset.json"


@dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    """What to generate. Every field takes part in the deterministic output.

    Args:
        num_classes: number of class folders (at most 16 named ones).
        per_class: images per class.
        min_side, max_side: range of the shorter / longer side in pixels.
        png_every: every n-th image of a class is written as PNG (0: none).
        quality: JPEG quality.
        seed: base seed.
    """

    num_classes: int = 10
    per_class: int = 80
    min_side: int = 200
    max_side: int = 800
    png_every: int = 40
    quality: int = 90
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.num_classes <= len(_CLASS_NAMES):
            raise ValueError(f"num_classes must be in 1..{len(_CLASS_NAMES)}, got {self.num_classes}")
        if self.per_class < 1:
            raise ValueError(f"per_class must be >= 1, got {self.per_class}")
        if not 16 <= self.min_side <= self.max_side:
            raise ValueError(f"need 16 <= min_side <= max_side, got {self.min_side}, {self.max_side}")
        if not 1 <= self.quality <= 100:
            raise ValueError(f"quality must be in 1..100, got {self.quality}")

    @property
    def classes(self) -> list[str]:
        return list(_CLASS_NAMES[: self.num_classes])


DEFAULT_SPEC = DatasetSpec()


def _pink_noise(rng: np.random.Generator, h: int, w: int, exponent: float) -> np.ndarray:
    """A field with a 1/f**exponent amplitude spectrum, normalised to zero mean, unit std."""
    fy = np.fft.fftfreq(h)[:, None]
    fx = np.fft.rfftfreq(w)[None, :]
    f = np.sqrt(fx * fx + fy * fy)
    f[0, 0] = 1.0
    spectrum = (rng.standard_normal((h, w // 2 + 1)) + 1j * rng.standard_normal((h, w // 2 + 1)))
    field = np.fft.irfft2(spectrum / f**exponent, s=(h, w))
    field -= field.mean()
    field /= field.std() + 1e-12
    return field.astype(np.float32)


def _image_size(rng: np.random.Generator, spec: DatasetSpec) -> tuple[int, int]:
    aspect = rng.choice([4 / 3, 3 / 2, 1.0, 16 / 9, 5 / 4])
    short = int(rng.integers(spec.min_side, max(spec.min_side + 1, min(spec.max_side, 500) + 1)))
    long = min(spec.max_side, max(short, int(round(short * aspect))))
    return (long, short) if rng.random() < 0.75 else (short, long)  # (width, height)


def render_image(spec: DatasetSpec, class_index: int, index: int) -> Image.Image:
    """One deterministic RGB image of class ``class_index``."""
    rng = np.random.default_rng([spec.seed, class_index, index])
    w, h = _image_size(rng, spec)
    # Low-frequency structure at quarter resolution, upsampled: cheap and photo-like.
    lh, lw = max(8, h // 4), max(8, w // 4)
    base = np.stack([_pink_noise(rng, lh, lw, 1.1) for _ in range(3)], axis=-1)
    class_rng = np.random.default_rng([spec.seed, 1_000_003, class_index])
    mix = class_rng.normal(0.0, 0.35, (3, 3)) + np.eye(3)
    mean = class_rng.uniform(60, 190, 3)
    low = (base @ mix.T) * 38.0 + mean
    low_img = Image.fromarray(np.clip(low, 0, 255).astype(np.uint8)).resize((w, h), Image.BICUBIC)
    draw = ImageDraw.Draw(low_img)
    # Class-specific shapes give the classes something learnable and add hard edges.
    for _ in range(int(rng.integers(3, 9))):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        r = int(rng.integers(max(4, min(w, h) // 20), max(5, min(w, h) // 4)))
        colour = tuple(int(c) for c in np.clip(mean[::-1] + rng.normal(0, 50, 3), 0, 255))
        if class_index % 3 == 0:
            draw.ellipse((x0 - r, y0 - r, x0 + r, y0 + r), fill=colour)
        elif class_index % 3 == 1:
            draw.rectangle((x0 - r, y0 - r // 2, x0 + r, y0 + r // 2), fill=colour)
        else:
            draw.polygon([(x0, y0 - r), (x0 - r, y0 + r), (x0 + r, y0 + r)], fill=colour)
    arr = np.asarray(low_img, dtype=np.float32)
    # Mid-frequency texture and sensor grain: this is where real photos get their entropy.
    texture = _pink_noise(rng, h, w, 0.8)[..., None] * 14.0
    grain = rng.standard_normal((h, w, 1), dtype=np.float32) * 5.0
    arr = np.clip(arr + texture + grain, 0, 255).astype(np.uint8)
    return Image.fromarray(arr, "RGB")


def _file_name(spec: DatasetSpec, class_index: int, index: int) -> str:
    ext = "png" if spec.png_every and index % spec.png_every == spec.png_every - 1 else "jpg"
    return f"{_CLASS_NAMES[class_index]}_{index:05d}.{ext}"


def encode_image(spec: DatasetSpec, class_index: int, index: int) -> bytes:
    """The file bytes for one sample, as written to disk."""
    img = render_image(spec, class_index, index)
    buf = io.BytesIO()
    if _file_name(spec, class_index, index).endswith(".png"):
        img.save(buf, "PNG", compress_level=1)
    else:
        img.save(buf, "JPEG", quality=spec.quality)
    return buf.getvalue()


def _write_one(args: tuple[DatasetSpec, str, int, int]) -> int:
    spec, root, class_index, index = args
    path = Path(root) / _CLASS_NAMES[class_index] / _file_name(spec, class_index, index)
    data = encode_image(spec, class_index, index)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # never leave a half-written image behind
    return len(data)


def _jobs(spec: DatasetSpec, root: Path) -> Iterator[tuple[DatasetSpec, str, int, int]]:
    for c in range(spec.num_classes):
        for i in range(spec.per_class):
            yield spec, str(root), c, i


def make_dataset(root: str | os.PathLike[str], spec: DatasetSpec = DEFAULT_SPEC, *,
                 workers: int | None = None, progress: bool = False) -> Path:
    """Write the synthetic ImageFolder tree to ``root`` and return it.

    Idempotent: a tree already complete for the same spec is left alone; an interrupted
    one is finished (files are written atomically, so no image is ever half-written).

    Raises:
        FastloadError: ``root`` holds a dataset made from a different spec.
    """
    import json

    root = Path(root)
    marker = root / _COMPLETE_MARKER
    wanted = asdict(spec)
    if marker.exists():
        have = json.loads(marker.read_text())
        if have == wanted:
            return root
        raise FastloadError(
            f"{root} holds a synthetic dataset made with {have}, not {wanted}.\n"
            "HINT: choose another folder, or delete this one to regenerate it."
        )
    for name in spec.classes:
        (root / name).mkdir(parents=True, exist_ok=True)
    jobs = [j for j in _jobs(spec, root)
            if not (root / _CLASS_NAMES[j[2]] / _file_name(spec, j[2], j[3])).exists()]
    workers = workers or min(available_cpus(), 8)
    from tqdm import tqdm

    with tqdm(total=len(jobs), desc=f"generating {root.name}", unit="img", disable=not progress) as bar:
        if workers <= 1 or len(jobs) < 16:
            for job in jobs:
                _write_one(job)
                bar.update()
        else:
            import multiprocessing as mp

            with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
                for _ in pool.map(_write_one, jobs, chunksize=8):
                    bar.update()
    marker.write_text(json.dumps(wanted, indent=1))
    return root


def cache_dir() -> Path:
    """fastload's cache folder: ``$FASTLOAD_CACHE``, else ``$XDG_CACHE_HOME/fastload`` or ``~/.cache/fastload``."""
    return Path(os.environ.get("FASTLOAD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fastload"))


def default_dataset_dir() -> Path:
    """Where the generated default dataset lives, in ``cache_dir()``."""
    tag = zlib.crc32(repr(sorted(asdict(DEFAULT_SPEC).items())).encode()) & 0xFFFF
    return cache_dir() / f"default-{tag:04x}"


def ensure_default_dataset(*, progress: bool = False) -> Path:
    """The default dataset, generated on first use (800 images, about 75 MB)."""
    return make_dataset(default_dataset_dir(), DEFAULT_SPEC, progress=progress)
