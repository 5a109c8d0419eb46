"""fastload.pack.sources: torchvision's ImageFolder order, file lists."""

from __future__ import annotations

import os

from torchvision.datasets import ImageFolder

from fastload.pack.sources import file_list, image_folder
from helpers import jpeg_bytes, photo


def test_imagefolder_order_is_torchvisions(tmp_path):
    data = jpeg_bytes(photo(16, 16))
    names = ["b/x/2.JPG", "b/x/10.jpeg", "b/1.png", "b/Z.webp", "a/q.jpg", "a/sub/deeper/r.jpg",
             "a/skip.txt", "c_empty_dir/.keep", "B/u.jpg"]
    for n in names:
        p = tmp_path / n
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    src = image_folder(tmp_path)
    tv = ImageFolder(str(tmp_path), allow_empty=True)
    assert src.classes == tv.classes
    assert src.items == [(os.path.relpath(p, tmp_path), t) for p, t in tv.samples]


def test_fingerprint_changes_with_content(tmp_path):
    (tmp_path / "a").mkdir()
    f = tmp_path / "a" / "1.jpg"
    f.write_bytes(b"x")
    before = image_folder(tmp_path).fingerprint()
    assert image_folder(tmp_path).fingerprint() == before
    f.write_bytes(b"xy")
    assert image_folder(tmp_path).fingerprint() != before


def test_file_list_headerless_names_sorted(tmp_path):
    lst = tmp_path / "l.txt"
    lst.write_text("# comment\n\nx/1.jpg,zebra\nx/2.jpg,ant\n")
    src = file_list(lst)
    assert src.classes == ["ant", "zebra"]
    assert src.items == [("x/1.jpg", 1), ("x/2.jpg", 0)]
    assert src.root == tmp_path
