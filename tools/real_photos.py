"""An ImageFolder tree of real photos at mixed sizes, for `bench loader` without a network.

    python tools/real_photos.py OUT [--per-class 80] [--classes 10] [--seed 0] [--from PATH ...]

The generated default dataset is synthetic; a JPEG decoder's speed depends on what is in the
picture, so the loader comparison is also run on real photos. With no network but PyPI, the
real photos at hand are the few that Python packages ship: scikit-image's `skimage/data`
(astronaut, chelsea, coffee, the two motorcycle views, rocket), scikit-learn's
`sklearn/datasets/images` (china, flower) and matplotlib's `sample_data/grace_hopper.jpg`:
nine colour photos of everyday scenes of 300-741 px. `--from` takes installed package folders,
plain folders or wheel files (`pip download --no-deps scikit-image scikit-learn matplotlib`
into a folder, then `--from` that folder: nothing is installed); only the nine files named in
`PHOTOS` are used.

Each output image is a random crop of one of the photos (area 25-100%, aspect 3:4-4:3), scaled
down (never up) to a longer side drawn from 200-640 px, and written as a baseline JPEG at
quality 90 with 4:2:0 chroma (what cameras and ImageNet's files mostly are), so the tree has
the mixed sizes of a real dataset and the content of real photos. It is still nine scenes: the
decode cost per pixel is a real photo's, the variety is not a real dataset's. Same seed, same
tree (byte for byte).

Must not: be imported by the package (a tool, run by hand).
"""

from __future__ import annotations

import argparse
import io
import random
import zipfile
from pathlib import Path

#: The colour photos of everyday scenes shipped in PyPI wheels (file name -> where it lies).
PHOTOS = {
    "astronaut.png": "skimage/data/", "chelsea.png": "skimage/data/", "coffee.png": "skimage/data/",
    "motorcycle_left.png": "skimage/data/", "motorcycle_right.png": "skimage/data/",
    "rocket.jpg": "skimage/data/", "china.jpg": "sklearn/datasets/images/",
    "flower.jpg": "sklearn/datasets/images/", "grace_hopper.jpg": "mpl-data/sample_data/",
}


def _installed() -> list[Path]:
    import importlib.util

    roots = []
    for pkg in ("skimage", "sklearn", "matplotlib"):
        spec = importlib.util.find_spec(pkg)
        if spec is not None and spec.origin:
            roots.append(Path(spec.origin).parent.parent)
    return roots


def find_photos(sources: list[Path]) -> dict[str, bytes]:
    """The bytes of every photo of ``PHOTOS`` found in ``sources`` (folders searched, wheels read)."""
    found: dict[str, bytes] = {}
    for src in sources:
        if src.is_file() and src.suffix in (".whl", ".zip"):
            with zipfile.ZipFile(src) as z:
                for name in z.namelist():
                    base = name.rsplit("/", 1)[-1]
                    if base in PHOTOS and PHOTOS[base] in name and base not in found:
                        found[base] = z.read(name)
        elif src.is_dir():
            for base, where in PHOTOS.items():
                if base in found:
                    continue
                hits = [p for p in src.rglob(base) if where in p.as_posix()]
                if hits:
                    found[base] = hits[0].read_bytes()
            for wheel in sorted(src.glob("*.whl")):
                found.update({k: v for k, v in find_photos([wheel]).items() if k not in found})
    return found


def make_tree(out: Path, photos: dict[str, bytes], *, classes: int, per_class: int, seed: int) -> int:
    from PIL import Image

    rng = random.Random(seed)
    images = [Image.open(io.BytesIO(photos[k])).convert("RGB") for k in sorted(photos)]
    n = 0
    for c in range(classes):
        folder = out / f"class_{c:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            img = images[rng.randrange(len(images))]
            w, h = img.size
            area = rng.uniform(0.25, 1.0) * w * h
            aspect = rng.uniform(3 / 4, 4 / 3)
            cw = min(w, max(16, round((area * aspect) ** 0.5)))
            ch = min(h, max(16, round((area / aspect) ** 0.5)))
            x, y = rng.randrange(w - cw + 1), rng.randrange(h - ch + 1)
            crop = img.crop((x, y, x + cw, y + ch))
            side = min(max(cw, ch), rng.randint(200, 640))
            scale = side / max(cw, ch)
            if scale < 1:
                crop = crop.resize((max(1, round(cw * scale)), max(1, round(ch * scale))), Image.LANCZOS)
            crop.save(folder / f"{c:02d}_{i:04d}.jpg", "JPEG", quality=90, subsampling=2)
            n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--per-class", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--from", dest="sources", type=Path, action="append", default=[],
                    help="a folder, installed package root or wheel holding the photos (repeatable)")
    a = ap.parse_args()
    photos = find_photos(a.sources or _installed())
    missing = sorted(set(PHOTOS) - set(photos))
    if not photos:
        raise SystemExit("none of the photos found.\nHINT: pip download --no-deps scikit-image scikit-learn "
                         "matplotlib -d WHEELS, then --from WHEELS")
    n = make_tree(a.out, photos, classes=a.classes, per_class=a.per_class, seed=a.seed)
    print(f"{n} JPEGs in {a.classes} classes from {len(photos)} real photos in {a.out}"
          + (f" (not found: {', '.join(missing)})" if missing else ""))


if __name__ == "__main__":
    main()
