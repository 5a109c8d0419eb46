"""How well does ``prepare()`` tell a bit-rotted JPEG from an intact one? False skips and false stores.

    python tools/jpeg_damage_table.py [--copies 6] [--seed 0] [--photos 12] [--markdown]

Builds a varied set of intact JPEGs (Pillow at several qualities and chroma subsamplings,
progressive, restart markers, grayscale, ICC and EXIF, encoder padding after the end marker
and between header segments, a grayscale file whose ICC profile markers are malformed, the
tests/image/data fixtures, and photo-like images from ``fastload.datasets``), then
``--copies`` bit-rotted copies of each (1..6 bytes of the entropy-coded scan data each
XOR-ed with a random non-zero value, seeded). Every file goes through
``fastload.image.policy.prepare`` (what ``convert`` stores or skips) and is counted:

* intact files skipped: false skips (each listed with its reason);
* rotted files stored: false stores, split into those libjpeg-turbo decodes without any
  warning (no decoder can tell them from an intact file: the known limit) and those it
  warned about (a rule could have caught them);
* the breakdown by what libjpeg-turbo's strict decode said first.

For a stored rotted copy the PSNR of what was stored against the intact file's pixels
says how far from the original it is. Run it against another checkout with
``PYTHONPATH=/that/checkout`` to compare rules (the breakdown's labels come from this
checkout either way).

Must not: be imported by the package (a tool, run by hand).
"""

from __future__ import annotations

import argparse
import functools
import io
import re
import struct
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
from PIL import Image, ImageCms

ROOT = Path(__file__).resolve().parents[1]


def _save(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kw)
    return buf.getvalue()


def _segment_end(data: bytes, marker: bytes) -> int:
    i = data.index(marker)
    return i + 2 + struct.unpack(">H", data[i + 2:i + 4])[0]


def _scan_range(data: bytes) -> tuple[int, int]:
    """Entropy-coded data of the first scan up to the end marker (the whole of it, all scans)."""
    start = _segment_end(data, b"\xff\xda")
    end = data.rindex(b"\xff\xd9")
    return start, end


def _icc_app2(seq: int, count: int) -> bytes:
    icc = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    body = b"ICC_PROFILE\0" + bytes([seq, count]) + icc
    return b"\xff\xe2" + struct.pack(">H", len(body) + 2) + body


def intact_set(photos: int) -> dict[str, bytes]:
    """Intact JPEGs of many kinds, by name."""
    from fastload.datasets import DatasetSpec, render_image

    spec = DatasetSpec(min_side=160, max_side=480)
    imgs = [render_image(spec, c % spec.num_classes, c) for c in range(photos)]
    icc = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    exif = Image.Exif()
    exif[0x010F] = "fastload-camera"
    exif[0x0112] = 1
    out: dict[str, bytes] = {}
    for i, img in enumerate(imgs):
        q = (50, 75, 85, 90, 95, 98)[i % 6]
        sub = (0, 1, 2)[i % 3]
        out[f"photo{i:02d}-q{q}-sub{sub}"] = _save(img, quality=q, subsampling=sub)
    a, b, c, d = imgs[0], imgs[1 % photos], imgs[2 % photos], imgs[3 % photos]
    out["progressive-q90"] = _save(a, quality=90, progressive=True)
    out["progressive-q75-420"] = _save(b, quality=75, progressive=True, subsampling=2)
    out["optimized-q85"] = _save(c, quality=85, optimize=True)
    out["restart-every-2-blocks"] = _save(d, quality=90, restart_marker_blocks=2)
    out["restart-every-row"] = _save(a, quality=80, restart_marker_rows=1)
    out["gray-q90"] = _save(b.convert("L"), quality=90)
    out["gray-progressive"] = _save(c.convert("L"), quality=80, progressive=True)
    out["icc-profile"] = _save(d, quality=90, icc_profile=icc)
    out["exif"] = _save(a, quality=90, exif=exif.tobytes())
    plain = _save(b, quality=90)
    out["padding-after-eoi-zeros"] = plain + b"\0" * 4096
    out["padding-after-eoi-text"] = plain + b"trailing data written by an uploader" * 8
    app0 = _segment_end(plain, b"\xff\xe0")
    out["padding-between-segments"] = plain[:app0] + b"\0\0\0\0" + plain[app0:]
    dqt = _segment_end(plain, b"\xff\xdb")
    out["padding-before-sof"] = plain[:dqt] + b"\x00" * 16 + plain[dqt:]
    gray = _save(c.convert("L"), quality=90)
    sof = _segment_end(gray, b"\xff\xc0")
    out["gray-icc-after-sof-malformed"] = gray[:2] + _icc_app2(1, 1) + gray[2:sof] + _icc_app2(1, 1) + gray[sof:]
    out["gray-icc-after-sof"] = gray[:sof] + _icc_app2(1, 1) + gray[sof:]
    sos = plain.index(b"\xff\xda")
    se = sos + 5 + 2 * plain[sos + 4] + 1
    out["sequential-sos-se-0"] = plain[:se] + b"\0" + plain[se + 1:]  # some encoders write Se=0; decoders ignore it
    for f in sorted((ROOT / "tests" / "image" / "data").glob("*.jpg")):
        out[f"fixture-{f.stem}"] = f.read_bytes()
    return out


def rotted(data: bytes, rng: np.random.Generator) -> tuple[bytes, int]:
    """A copy with 1..6 scan-data bytes each XOR-ed with a random non-zero value."""
    start, end = _scan_range(data)
    b = bytearray(data)
    flips = int(rng.integers(1, 7))
    for pos in rng.choice(np.arange(start, end), size=min(flips, end - start), replace=False):
        b[int(pos)] ^= int(rng.integers(1, 256))
    return bytes(b), flips


def libjpeg_says(data: bytes) -> str:
    """libjpeg-turbo's first strict-mode complaint, with numbers folded ('clean' when none); when
    it is about the header, what it says about the rest once the header's stray bytes, ICC
    markers and sequential scan-header fields are set aside."""
    first = _first_complaint(data)
    cleaned, _ = _cleaner()(data)
    then = _first_complaint(cleaned) if cleaned != data else first
    return first if then == first else f"{first}; header set aside: {then}"


@functools.lru_cache(maxsize=1)
def _cleaner():
    """``jpeg_header_cleaned`` from this tool's own checkout, so that the breakdown labels the same
    files the same way whichever checkout's ``prepare`` is measured."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_table_damage", ROOT / "fastload" / "image" / "damage.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.jpeg_header_cleaned


def _first_complaint(data: bytes) -> str:
    import simplejpeg

    try:
        simplejpeg.decode_jpeg(data, strict=True)
        return "clean"
    except ValueError as exc:
        msg = re.sub(r"\b\d+ extraneous", "N extraneous", str(exc))
        msg = re.sub(r"marker 0xd[0-7]\b", "marker 0xd0-0xd7 (RSTn)", msg)
        return re.sub(r"RST\d", "RSTn", re.sub(r"marker type 0x[0-9a-f]+", "marker type 0xNN", msg))


def _pixels(data: bytes) -> np.ndarray | None:
    from fastload.image.policy import decode_rgb

    try:
        return decode_rgb(data)
    except Exception:
        return None


def run(copies: int, seed: int, photos: int) -> dict:
    from fastload.image.policy import BadImage, decode_rgb, prepare, psnr

    rng = np.random.default_rng(seed)
    rows: dict = {"intact": Counter(), "false_skips": [], "not_usable": [], "rot": defaultdict(Counter),
                  "rot_psnr": defaultdict(list), "rot_total": 0, "intact_total": 0}
    for name, data in intact_set(photos).items():
        try:
            p = prepare(data)
            rows["intact"][p.stored_as] += 1
        except BadImage as exc:
            if "12-bit" in str(exc):  # unusable for Pillow/ImageFolder whatever its state: not a damage verdict
                rows["not_usable"].append((name, str(exc)))
                continue
            rows["false_skips"].append((name, libjpeg_says(data), str(exc)))
            rows["intact"]["skipped"] += 1
        rows["intact_total"] += 1
        truth = decode_rgb(data)
        for _ in range(copies):
            bad, _flips = rotted(data, rng)
            said = libjpeg_says(bad)
            rows["rot_total"] += 1
            try:
                p = prepare(bad)
            except BadImage:
                rows["rot"][said]["skipped"] += 1
                continue
            stored = _pixels(p.data)
            same = stored is not None and stored.shape == truth.shape
            value = psnr(truth, stored) if same else 0.0
            rows["rot"][said]["stored"] += 1
            rows["rot_psnr"][said].append(value)
    return rows


def _table(rows: dict, markdown: bool) -> str:
    lines = []
    it = rows["intact"]
    skipped = it.get("skipped", 0)
    lines.append(f"intact JPEGs: {rows['intact_total']}  stored as original {it.get('original', 0)}, "
                 f"canonicalised {it.get('canonicalised', 0)}, skipped (false skips) {skipped}")
    for name, said, why in rows["false_skips"]:
        lines.append(f"  false skip: {name}: libjpeg-turbo: {said}; prepare: {why}")
    for name, why in rows["not_usable"]:
        lines.append(f"  left out (not usable whatever its state): {name}: {why}")
    rot = rows["rot"]
    stored = sum(c["stored"] for c in rot.values())
    silent = sum(c["stored"] for k, c in rot.items() if k.endswith("clean"))
    lines.append(f"bit-rotted copies: {rows['rot_total']}  skipped {rows['rot_total'] - stored}, "
                 f"stored (false stores) {stored}: {silent} whose scan libjpeg-turbo decodes without "
                 f"a warning (undetectable), {stored - silent} it warned about")
    lines.append("")
    if markdown:
        lines.append("| libjpeg-turbo (strict) says | rotted copies | skipped | stored | PSNR of stored vs intact "
                     "(median / min dB) |")
        lines.append("|---|---:|---:|---:|---|")
    for said, c in sorted(rot.items(), key=lambda kv: -sum(kv[1].values())):
        n = c["skipped"] + c["stored"]
        ps = rows["rot_psnr"].get(said, [])
        q = f"{np.median(ps):.1f} / {min(ps):.1f}" if ps else "-"
        if markdown:
            lines.append(f"| {said} | {n} | {c['skipped']} | {c['stored']} | {q} |")
        else:
            lines.append(f"{n:5d} {c['skipped']:5d} skipped {c['stored']:5d} stored  psnr {q:>13}  {said}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--copies", type=int, default=6, help="bit-rotted copies of each intact file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--photos", type=int, default=12, help="photo-like images from fastload.datasets")
    ap.add_argument("--markdown", action="store_true", help="print the breakdown as a Markdown table")
    args = ap.parse_args(argv)
    print(_table(run(args.copies, args.seed, args.photos), args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
