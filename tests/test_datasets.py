"""fastload.datasets: the generated default data is deterministic and photo-like."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from PIL import Image

from fastload.datasets import DEFAULT_SPEC, DatasetSpec, encode_image, make_dataset
from fastload.errors import FastloadError


def digest(root):
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.name.startswith(".")}


def test_same_spec_same_bytes(tmp_path):
    spec = DatasetSpec(num_classes=2, per_class=5, min_side=40, max_side=90, png_every=2)
    a = digest(make_dataset(tmp_path / "a", spec, workers=1))
    b = digest(make_dataset(tmp_path / "b", spec, workers=2))
    assert a == b and len(a) == 10
    assert sum(k.endswith(".png") for k in a) == 4


def test_default_images_look_like_photos():
    sizes, bpp = [], []
    for i in range(6):
        data = encode_image(DEFAULT_SPEC, i % DEFAULT_SPEC.num_classes, i)
        import io

        img = Image.open(io.BytesIO(data))
        sizes.append(img.size)
        bpp.append(len(data) * 8 / (img.size[0] * img.size[1]))
        arr = np.asarray(img.convert("L"), dtype=float)
        assert arr.std() > 20  # not flat colour
    assert all(200 <= min(s) and max(s) <= 800 for s in sizes)
    assert 1.0 < np.mean(bpp) < 6.0  # photo-like JPEG entropy


def test_other_spec_in_same_folder_is_refused(tmp_path):
    make_dataset(tmp_path, DatasetSpec(num_classes=1, per_class=1, min_side=32, max_side=40), workers=1)
    with pytest.raises(FastloadError, match="different|not"):
        make_dataset(tmp_path, DatasetSpec(num_classes=1, per_class=2, min_side=32, max_side=40), workers=1)
