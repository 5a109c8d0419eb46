"""Helpers that build test images in memory: plain, special (need normalising), and bad."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image


def copy_tree(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    (dst / ".fastload-dataset.json").unlink(missing_ok=True)
    return dst


def photo(w: int = 96, h: int = 64, seed: int = 0) -> Image.Image:
    """A small RGB image with texture (so JPEG round trips are not trivial)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h)], -1)
    arr = np.clip(base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(arr, "RGB")


def jpeg_bytes(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=kw.pop("quality", 90), **kw)
    return buf.getvalue()


def png_bytes(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG", **kw)
    return buf.getvalue()


def exif_rotated_jpeg(orientation: int = 6) -> bytes:
    img = photo(80, 48, seed=3)
    exif = Image.Exif()
    exif[0x0112] = orientation
    return jpeg_bytes(img, exif=exif.tobytes())


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb_png(side: int = 20000) -> bytes:
    """A valid PNG header claiming side×side pixels, with a tiny (truncated) image stream."""
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr)
            + png_chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + png_chunk(b"IEND", b""))


def special_images() -> dict[str, bytes]:
    """Valid images that decoders disagree on, by name; each must be canonicalised."""
    base = photo(72, 56, seed=5)
    rgba = base.convert("RGBA")
    rgba.putalpha(128)
    pal = base.convert("P", palette=Image.ADAPTIVE, colors=32)
    pal.info["transparency"] = 0
    gray16 = Image.fromarray(np.asarray(base.convert("L")).astype(np.uint16) * 257)
    buf = io.BytesIO()
    base.save(buf, "WEBP", quality=90)
    webp = buf.getvalue()
    buf = io.BytesIO()
    base.save(buf, "BMP")
    bmp = buf.getvalue()
    buf = io.BytesIO()
    base.convert("CMYK").save(buf, "JPEG", quality=92)
    cmyk = buf.getvalue()
    return {
        "exif6.jpg": exif_rotated_jpeg(6),
        "cmyk.jpg": cmyk,
        "rgba.png": png_bytes(rgba),
        "palette.png": png_bytes(pal),
        "gray16.png": png_bytes(gray16),
        "photo.webp": webp,
        "photo.bmp": bmp,
    }


def plain_images() -> dict[str, bytes]:
    """Valid images whose original bytes are stored as they are."""
    base = photo(90, 60, seed=9)
    return {
        "rgb.jpg": jpeg_bytes(base),
        "gray.jpg": jpeg_bytes(base.convert("L")),
        "progressive.jpg": jpeg_bytes(base, progressive=True),
        "rgb.png": png_bytes(base),
        "gray.png": png_bytes(base.convert("L")),
    }


def bad_files() -> dict[str, bytes]:
    good = jpeg_bytes(photo(64, 64, seed=11))
    return {
        "truncated.jpg": good[: len(good) // 2],
        "empty.jpg": b"",
        "notimage.jpg": b"this is a text file, not a JPEG\n" * 10,
        "bomb.png": bomb_png(),
    }


def jpeg_bomb(side: int = 20000) -> bytes:
    """A valid small JPEG whose frame header claims side x side pixels."""
    data = bytearray(jpeg_bytes(photo(32, 32)))
    i = data.index(b"\xff\xc0")
    data[i + 5:i + 9] = side.to_bytes(2, "big") + side.to_bytes(2, "big")
    return bytes(data)


def edit_store(store: Path, fn) -> None:
    """Change a store's LMDB records directly, as damage would (``fn(txn)``)."""
    import lmdb

    env = lmdb.open(str(store), map_size=1 << 30)
    with env.begin(write=True) as txn:
        fn(txn)
    env.close()


def rewrite_meta(store: Path, mutate) -> None:
    """Write self-consistent (checksummed) metadata after ``mutate(header, arrays, paths)`` changed it."""
    from fastload.store import format as fmt
    from fastload.store.reader import StoreReader

    meta = StoreReader(store).metas[0]
    arrays = {"labels": meta.labels.copy(), "crc32": meta.crc32.copy(), "encoding": meta.encoding.copy(),
              "stored_as": meta.stored_as.copy()}
    header = {k: v for k, v in meta.header.items() if k != "checksums"}
    paths = list(meta.paths)
    mutate(header, arrays, paths)
    edit_store(store, lambda t: [t.put(k, v) for k, v in fmt.meta_records(header, arrays, paths)])


def put_undecodable(store: Path, index: int) -> bytes:
    """Replace record ``index`` by bytes no decoder reads, with a matching checksum (not bit rot)."""
    from fastload.store import format as fmt

    junk = b"\xff\xd8\xff\xe0" + b"\x00" * 200
    edit_store(store, lambda t: t.put(fmt.sample_key(index), junk))
    rewrite_meta(store, lambda h, a, p: a["crc32"].__setitem__(index, zlib.crc32(junk)))
    return junk


# the first lines of a script for ``exit_handler_seconds``: registered first, this exit handler runs last
EXIT_TIMER = "import atexit, time\natexit.register(lambda: print('atexit', time.time(), flush=True))\n"


def exits_cleanly(script: Path, said: str, runs: int = 3) -> None:
    """Run ``script`` ``runs`` times: each prints ``said`` and exits with status 0, without the abort of a
    daemon thread ended inside C++ frames ("terminate called without an active exception", status 134)."""
    import subprocess
    import sys

    for _ in range(runs):
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert said in proc.stdout, proc.stderr
        assert proc.returncode == 0 and "terminate called" not in proc.stderr, (proc.returncode, proc.stderr)


def exit_handler_seconds(script: Path) -> tuple[str, float]:
    """Run ``script`` (which starts with ``EXIT_TIMER`` and prints ``leaving <time.time()>`` as its last
    line); its stdout and the seconds from ``leaving`` to the last exit handler. Asserts exit status 0."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    left = float(proc.stdout.split("leaving")[1].split()[0])
    last_handler = float(proc.stdout.split("atexit")[1].split()[0])
    return proc.stdout, last_handler - left


def _train_transform_class():
    from fastload.load.transforms import TrainTransform

    return TrainTransform


class RenderFails(_train_transform_class()):
    """The train preset whose render fails on every other call in a process: the thread pipeline and the
    worker processes must redo those samples with getitem (same pixels, the sample named on errors)."""

    calls = 0

    def render(self, data, plan, *, out=None):
        type(self).calls += 1
        if type(self).calls % 2:
            raise RuntimeError("render failed (injected)")
        return super().render(data, plan, out=out)
