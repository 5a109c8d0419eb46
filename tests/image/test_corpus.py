"""The adversarial corpus through ``fastload convert``: nothing bad is stored, nothing good is lost,
and every stored sample decodes to the same pixels with every decoder fastload reads with.

Every test runs on two stores: ``--lossless`` (the corpus's ``expect`` as written: PNG originals
kept, other non-JPEG sources as bit-exact PNG) and the default (every non-JPEG source as JPEG
q95 4:4:4, its PSNR recorded)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image

from corpus import kinds, user_view
from fastload.load.dataset import LMDBImageDataset
from fastload.pack.convert import ConvertOptions, convert
from fastload.store import format as fmt

KINDS = {k.name: k for k in kinds()}
#: canonicalised JPEG sources are re-encoded at quality 95, 4:4:4: mean |difference| per channel value
#: (README: under 4 levels on these noise-textured images, about 1 on photographs)
CANONICAL_JPEG_BOUND = 4.0


#: the default re-encode of non-JPEG sources (JPEG q95 4:4:4) on these noise-textured corpus images
REENCODED_MIN_PSNR = 30.0


@pytest.fixture(scope="module", params=[True, False], ids=["lossless", "default"])
def corpus_store(tmp_path_factory, request):
    tree = tmp_path_factory.mktemp("corpus") / "tree"
    for k in KINDS.values():
        path = tree / k.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(k.data)
    # a file list, so that formats torchvision's ImageFolder does not list (.gif) go through too
    listing = tree / "files.csv"
    listing.write_text("".join(f"{k.name},{k.name.split('/')[0]}\n" for k in KINDS.values()))
    store = tree.parent / "store.lmdb"
    report = convert(listing, store, ConvertOptions(progress=False, workers=2, lossless=request.param))
    ds = LMDBImageDataset(store)
    stored = {rel: i for i, (rel, _) in enumerate(ds.samples)}
    skipped = {s["relpath"]: s["reason"] for s in report.skipped}
    return ds, stored, skipped, report, request.param


def _is_jpeg(data: bytes) -> bool:
    return data[:3] == b"\xff\xd8\xff"


def test_corpus_is_large_and_covers_every_outcome():
    assert len(KINDS) >= 40
    assert {k.expect for k in KINDS.values()} == {"original", "canonical", "skip"}


@pytest.mark.parametrize("name", sorted(KINDS))
def test_each_kind_is_stored_right_or_skipped_with_its_reason(corpus_store, name):
    ds, stored, skipped, _, lossless = corpus_store
    kind = KINDS[name]
    if kind.expect == "skip":
        assert name not in stored, f"{name} must not be stored"
        assert name in skipped, f"{name} must be reported as skipped"
        import re

        assert re.search(kind.why, skipped[name], re.I), skipped[name]
        return
    assert name not in skipped, f"{name} was skipped: {skipped.get(name)}"
    i = stored[name]
    data = ds.get_bytes(i)
    how = fmt.STORED_AS[ds._reader.metas[0].stored_as[i]]
    got = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    want = user_view(kind.data)
    assert got.shape == want.shape
    if not lossless and not _is_jpeg(kind.data):  # the default: every non-JPEG source as JPEG q95 4:4:4
        assert how == "reencoded" and _is_jpeg(data), how
        assert np.abs(got.astype(int) - want.astype(int)).mean() <= CANONICAL_JPEG_BOUND
        return
    if kind.expect == "original":
        assert how == "original" and data == kind.data
        np.testing.assert_array_equal(got, want)
    else:
        assert how == "canonicalised", how
        if data[:3] == b"\xff\xd8\xff":
            assert np.abs(got.astype(int) - want.astype(int)).mean() <= CANONICAL_JPEG_BOUND
        else:
            np.testing.assert_array_equal(got, want)


def test_report_counts_canonicalised_by_reason(corpus_store):
    _, _, _, report, lossless = corpus_store
    kept = [k for k in KINDS.values() if k.expect != "skip"]
    converted = [k for k in kept if lossless or _is_jpeg(k.data)]
    assert sum(report.canonicalised.values()) == sum(k.expect == "canonical" for k in converted)
    assert any("EXIF orientation" in r for r in report.canonicalised)
    reencoded = len(kept) - len(converted)
    assert report.reencoded == sum(report.reencoded_reasons.values()) == reencoded
    assert all(r.endswith("stored as JPEG q95 4:4:4 (lossy; --lossless keeps it exact)")
               for r in report.reencoded_reasons)
    # every JPEG fastload wrote (canonicalised JPEG sources and re-encoded others) has its PSNR recorded
    lossy = sum(k.expect == "canonical" and _is_jpeg(k.data) for k in kept) + reencoded
    assert report.lossy["count"] == lossy
    assert REENCODED_MIN_PSNR <= report.lossy["psnr_min"] <= report.lossy["psnr_median"] <= 100.0


_DECODE = textwrap.dedent("""
    import io, json, sys
    import numpy as np
    from PIL import Image
    from fastload.load.dataset import LMDBImageDataset

    ds = LMDBImageDataset(sys.argv[1])
    decoder = sys.argv[2]
    bad = []
    for i in range(len(ds)):
        data = ds.get_bytes(i)
        ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        if decoder == "pil":
            got = ref
        elif decoder == "torchvision":
            import torch
            from torchvision.io import ImageReadMode, decode_image
            got = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                               mode=ImageReadMode.RGB).permute(1, 2, 0).numpy()
        elif decoder == "simplejpeg":
            if data[:3] != b"\\xff\\xd8\\xff":
                continue
            import simplejpeg
            got = simplejpeg.decode_jpeg(data, colorspace="RGB")
        elif decoder == "fastload":
            from fastload.image.fast import decode_rgb_fast
            got = decode_rgb_fast(data)
        if got.shape != ref.shape or not np.array_equal(got, ref):
            bad.append([i, ds.samples[i][0]])
    print(json.dumps(bad))
""")


@pytest.mark.parametrize("decoder", ["pil", "torchvision", "simplejpeg", "fastload"])
def test_every_stored_sample_decodes_alike(corpus_store, decoder):
    """Each decoder in its own process: a segfault is a test failure, not a crashed suite."""
    ds, *_ = corpus_store
    proc = subprocess.run([sys.executable, "-c", _DECODE, str(ds.root), decoder], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{decoder} crashed (rc {proc.returncode}): {proc.stderr[-2000:]}"
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


_DALI = textwrap.dedent("""
    import io, json, sys
    import numpy as np
    from PIL import Image
    from nvidia.dali import fn, pipeline_def, types
    from fastload.load.dataset import LMDBImageDataset

    ds = LMDBImageDataset(sys.argv[1])
    blobs = [np.frombuffer(ds.get_bytes(i), dtype=np.uint8) for i in range(len(ds))]

    def source(info):
        return blobs[info.idx_in_epoch % len(blobs)]

    @pipeline_def(batch_size=1, num_threads=1, device_id=None, exec_dynamic=True)
    def pipe():
        data = fn.external_source(source=source, batch=False, dtype=types.UINT8, ndim=1)
        return fn.decoders.image(data, device="cpu", output_type=types.RGB)

    p = pipe()
    p.build()
    bad = []
    for i in range(len(ds)):
        got = np.asarray(p.run()[0].as_tensor())[0]
        ref = np.asarray(Image.open(io.BytesIO(ds.get_bytes(i))).convert("RGB"))
        diff = np.abs(got.astype(int) - ref.astype(int)).mean() if got.shape == ref.shape else 255.0
        if diff > 0.5:  # DALI's CPU JPEG decode may round a few values differently; bound documented
            bad.append([i, ds.samples[i][0], float(diff)])
    print(json.dumps(bad))
""")


@pytest.mark.dali
def test_every_stored_sample_decodes_alike_with_dali_cpu(corpus_store):
    ds, *_ = corpus_store
    proc = subprocess.run([sys.executable, "-c", _DALI, str(ds.root)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"DALI crashed (rc {proc.returncode}): {proc.stderr[-2000:]}"
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
