"""Stores that never lie: damaged records, metadata and LMDB files end in a named error, never in
wrong data, a raw traceback or a dead process."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from click.testing import CliRunner
from torch.utils.data import DataLoader

from fastload.cli import main
from fastload.errors import ChecksumError, CorruptSampleError, StoreDamagedError
from fastload.load.dataset import LMDBImageDataset
from fastload.store import format as fmt
from fastload.store.reader import StoreReader
from helpers import edit_store, put_undecodable, rewrite_meta


@pytest.fixture
def store(tmp_path, tiny_store):
    dst = tmp_path / "copy.lmdb"
    shutil.copytree(tiny_store, dst)
    return dst


edit = edit_store


def flip(value: bytes, at: int, mask: int = 0x01) -> bytes:
    b = bytearray(value)
    b[at] ^= mask
    return bytes(b)


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


# ---- records ---------------------------------------------------------------------------------


def test_flipped_bit_in_a_record_is_a_checksum_error_naming_the_sample(store):
    edit(store, lambda t: t.put(fmt.sample_key(3), flip(t.get(fmt.sample_key(3)), 700)))
    ds = LMDBImageDataset(store)
    with pytest.raises(ChecksumError, match=r"sample 3 \(.*\).*fail their checksum") as info:
        ds[3]
    assert info.value.index == 3 and info.value.relpath == ds.samples[3][0]
    assert isinstance(info.value, CorruptSampleError)


def test_eight_changed_bytes_in_a_jpeg_record_never_reach_a_decoder(store):
    edit(store, lambda t: t.put(fmt.sample_key(0), t.get(fmt.sample_key(0))[:400] + b"\x00" * 8
                                + t.get(fmt.sample_key(0))[408:]))
    with pytest.raises(ChecksumError, match="sample 0"):
        LMDBImageDataset(store).get_bytes(0)


def test_swapped_records_are_caught(store):
    def swap(t):
        a, b = t.get(fmt.sample_key(1)), t.get(fmt.sample_key(2))
        t.put(fmt.sample_key(1), b)
        t.put(fmt.sample_key(2), a)

    edit(store, swap)
    ds = LMDBImageDataset(store)
    for i in (1, 2):
        with pytest.raises(ChecksumError, match=f"sample {i} "):
            ds[i]


def test_skip_policy_skips_a_record_that_fails_its_checksum(store):
    edit(store, lambda t: t.put(fmt.sample_key(4), flip(t.get(fmt.sample_key(4)), 500)))
    ds = LMDBImageDataset(store, on_error="skip")
    image, label = ds[4]
    assert ds.skipped == 1 and label == ds.targets[5]


def test_dataloader_workers_name_the_damaged_sample(store):
    edit(store, lambda t: t.put(fmt.sample_key(6), flip(t.get(fmt.sample_key(6)), 300)))
    loader = DataLoader(LMDBImageDataset(store), batch_size=4, num_workers=2, collate_fn=lambda b: b)
    with pytest.raises(CorruptSampleError, match="sample 6"):
        for _ in loader:
            pass


def test_checksums_can_be_switched_off_for_people_who_check_elsewhere(store):
    edit(store, lambda t: t.put(fmt.sample_key(3), flip(t.get(fmt.sample_key(3)), 700)))
    assert StoreReader(store, verify=False).get(3) != StoreReader(store, verify=False).get(2)


# ---- metadata ----------------------------------------------------------------------------------

PARTS = {"labels": fmt.array_key("labels"), "crc32": fmt.array_key("crc32"), "encoding": fmt.array_key("encoding"),
         "stored_as": fmt.array_key("stored_as"), "paths": fmt.PATHS_KEY}


@pytest.mark.parametrize("part", sorted(PARTS))
def test_flipped_bit_in_each_metadata_record_is_a_named_damage(store, part):
    key = PARTS[part]
    edit(store, lambda t: t.put(key, flip(t.get(key), len(t.get(key)) - 1)))
    with pytest.raises(StoreDamagedError, match=rf"metadata record '{part}' fails its checksum"):
        LMDBImageDataset(store)
    r = cli("verify", store, "--quiet")
    assert r.exit_code == 1 and "damaged" in r.output and "Traceback" not in r.output
    assert cli("inspect", store).exit_code == 1


def test_extra_nul_in_paths_is_caught(store):
    edit(store, lambda t: t.put(fmt.PATHS_KEY, t.get(fmt.PATHS_KEY).replace(b"\0", b"\0\0", 1)))
    with pytest.raises(StoreDamagedError, match="paths"):
        LMDBImageDataset(store)


def test_changed_class_name_in_the_header_is_caught(store):
    edit(store, lambda t: t.put(fmt.META_KEY, t.get(fmt.META_KEY).replace(b'"aurora"', b'"aurorb"')))
    with pytest.raises(StoreDamagedError, match="header fails its checksum"):
        LMDBImageDataset(store)


def test_broken_metadata_json_is_a_named_damage_not_a_traceback(store):
    raw = b'{"format": "fastload-lmdb", "version": 2, "count": '  # cut short, with a matching checksum
    edit(store, lambda t: (t.put(fmt.META_KEY, raw), t.put(fmt.META_CHECK_KEY, fmt.crc_hex(raw).encode())))
    with pytest.raises(StoreDamagedError, match="not valid JSON"):
        LMDBImageDataset(store)
    r = cli("inspect", store)
    assert r.exit_code == 1 and "not valid JSON" in r.output


def test_label_out_of_range_is_caught_even_with_valid_checksums(store):
    rewrite_meta(store, lambda h, a, p: a["labels"].__setitem__(5, 99))
    with pytest.raises(StoreDamagedError, match=r"sample 5 has label 99, outside 0\.\.2"):
        LMDBImageDataset(store)


def test_wrong_count_is_caught(store):
    rewrite_meta(store, lambda h, a, p: h.__setitem__("count", h["count"] + 1))
    with pytest.raises(StoreDamagedError, match="expected"):
        LMDBImageDataset(store)


def test_invalid_utf8_in_paths_does_not_crash(store):
    rewrite_meta(store, lambda h, a, p: p.__setitem__(0, "caf\udce9.jpg"))
    ds = LMDBImageDataset(store)
    assert ds.samples[0][0].encode("utf-8", "surrogateescape") == b"caf\xe9.jpg"


# ---- truncated or damaged LMDB files -------------------------------------------------------------

_READ_ALL = textwrap.dedent("""
    import sys
    from fastload.errors import FastloadError
    from fastload.load.dataset import LMDBImageDataset
    try:
        ds = LMDBImageDataset(sys.argv[1])
        for i in range(len(ds)):
            ds[i]
    except FastloadError as exc:
        print(exc)
        sys.exit(3)
""")


@pytest.mark.parametrize("size", ["half", 8192, 4097, 0])
def test_truncated_data_file_is_refused_with_a_message_not_sigbus(store, size):
    data = store / "data.mdb"
    full = data.stat().st_size
    keep = full // 2 if size == "half" else size
    with open(data, "r+b") as f:
        f.truncate(keep)
    for argv in ([sys.executable, "-c", _READ_ALL, str(store)],
                 [sys.executable, "-m", "fastload.cli", "verify", str(store), "--quiet"],
                 [sys.executable, "-m", "fastload.cli", "inspect", str(store)]):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode in (1, 3), f"{argv[-2:]}: rc {proc.returncode} (a signal is a crash): {out[-800:]}"
        assert "damaged" in out and ("cut short" in out or "empty" in out), out
        assert "Traceback" not in out


def test_lmdb_reading_errors_become_store_damage(store):
    data = store / "data.mdb"
    raw = bytearray(data.read_bytes())
    page = 4096
    for off in range(2 * page, len(raw), page):  # scribble over every page header past the meta pages
        raw[off:off + 16] = b"\xa5" * 16
    data.write_bytes(bytes(raw))
    proc = subprocess.run([sys.executable, "-c", _READ_ALL, str(store)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "damaged" in proc.stdout


# ---- verify --------------------------------------------------------------------------------------


def test_verify_checks_every_decoder_and_reports_each(store):
    r = cli("verify", store, "--quiet", "--decoders", "fastload,pil,torchvision,simplejpeg", "--json")
    out = json.loads(r.output)
    assert r.exit_code == 0 and out["ok"] and out["decoders"] == ["fastload", "pil", "torchvision", "simplejpeg"]

    edit(store, lambda t: t.put(fmt.sample_key(2), flip(t.get(fmt.sample_key(2)), 900)))
    r = cli("verify", store, "--quiet", "--decoders", "pil,simplejpeg", "--json")
    out = json.loads(r.output)
    assert r.exit_code == 1 and out["failing_by_decoder"]["checksum"] == [2]


def test_verify_names_a_record_that_decodes_badly_even_with_a_matching_checksum(store):
    """A record whose checksum matches but which no decoder can read (written by hand)."""
    put_undecodable(store, 7)
    out = json.loads(cli("verify", store, "--quiet", "--decoders", "fastload,pil,torchvision", "--json").output)
    assert {k: v for k, v in out["failing_by_decoder"].items() if v} == {"fastload": [7], "pil": [7],
                                                                          "torchvision": [7]}
    assert np.array_equal([f["index"] for f in out["failures"]], [7, 7, 7])


def test_unknown_decoder_is_a_clear_cli_error(store):
    r = CliRunner().invoke(main, ["verify", str(store), "--decoders", "opencv"])
    assert r.exit_code == 2 and "unknown decoder 'opencv'" in r.output


# ---- verify of a local folder of shards: its manifest and samples.json.gz ------------------------


@pytest.fixture(scope="module")
def sharded(tiny_tree, tmp_path_factory):
    from fastload.pack.convert import ConvertOptions
    from fastload.pack.engines import EngineOptions, convert_sharded

    dst = tmp_path_factory.mktemp("sharded") / "store"
    convert_sharded(tiny_tree, dst, ConvertOptions(progress=False, lossless=True, workers=1),
                    EngineOptions(num_shards=3))
    return dst


def _relabelled(store, manifest):
    """samples.json.gz rewritten with one label changed, and the manifest updated to name it: both agree
    with each other, not with the shards."""
    from fastload.store.manifest import parse_samples, samples_object

    labels, paths = parse_samples((store / "samples.json.gz").read_bytes(), manifest)
    labels[5] = (labels[5] + 1) % len(manifest.classes)
    data, entry = samples_object(labels, paths)
    (store / "samples.json.gz").write_bytes(data)
    (store / "manifest.json").write_text(dataclasses.replace(manifest, samples=entry).to_json())


@pytest.mark.parametrize("damage, expected", [
    ("truncated", r"samples\.json\.gz: \d+ bytes of sha256 .* the manifest says"),
    ("missing", r"samples\.json\.gz: missing: the labels object was deleted"),
    ("relabelled", r"samples\.json\.gz: sample 5 \(.*\) has label \d in its shard, \d .* not the shards"),
    ("shard-missing", r"manifest\.json: it names 3 shards, the folder holds 3; at position 0 the manifest names "
                      r"shard-00000-of-00004 \(8 samples\), the folder holds shard-00000-of-00003"),
    ("classes-permuted", r"manifest\.json: its class names are not the shards' \(3 vs 3 classes, first difference"),
], ids=["truncated", "missing", "relabelled", "shard-missing", "classes-permuted"])
def test_local_verify_checks_the_manifest_and_samples_object(sharded, tmp_path, damage, expected):
    """`fastload verify DIR` checks samples.json.gz as `fastload verify s3://...` does (size, sha256,
    content), and against the shards' own labels and paths: each damage a named error with a HINT."""
    from fastload.store.manifest import Manifest

    store = tmp_path / "store"
    shutil.copytree(sharded, store)
    r = cli("verify", store, "--quiet", "--workers", "1")
    assert r.exit_code == 0 and "24 samples checked, OK" in r.output
    manifest = Manifest.from_json((store / "manifest.json").read_text())
    if damage == "truncated":
        (store / "samples.json.gz").write_bytes((store / "samples.json.gz").read_bytes()[:-1])
    elif damage == "missing":
        (store / "samples.json.gz").unlink()
    elif damage == "relabelled":
        _relabelled(store, manifest)
    elif damage == "classes-permuted":  # every label would be handed out with another class's name
        classes = manifest.classes[1:] + manifest.classes[:1]
        (store / "manifest.json").write_text(dataclasses.replace(manifest, classes=classes).to_json())
    else:  # the manifest names a shard the folder no longer holds (its shard set still reads as one store)
        entries = [dataclasses.replace(e, name=f"shard-0000{i}-of-00004") for i, e in enumerate(manifest.shards)]
        (store / "manifest.json").write_text(dataclasses.replace(manifest, shards=tuple(entries)).to_json())
    r = cli("verify", store, "--quiet", "--workers", "1")
    assert r.exit_code == 1
    assert re.search(re.escape(f"{store}/") + expected, r.output) and "HINT" in r.output, r.output


@pytest.mark.parametrize("where", ["appended", "record", "format-1"])
def test_local_verify_checks_each_shard_file_against_the_manifest(sharded, tmp_path, where):
    """A shard file changed after its manifest was written (bytes appended, which no record read sees, or a
    byte flipped in a record) is named by its file, before a copy in a bucket is refused by every reader's
    size and sha256 check; a flipped record byte is named by its sample too."""
    import json

    from fastload.store.manifest import Manifest

    store = tmp_path / "store"
    shutil.copytree(sharded, store)
    manifest = Manifest.from_json((store / "manifest.json").read_text())
    shard = store / manifest.shards[1].name / "data.mdb"
    data = bytearray(shard.read_bytes())
    if where == "record":
        from fastload.store.reader import StoreReader

        reader = StoreReader(store)
        first = reader.offsets[1]
        record = reader.get(first, verify=False)
        at = data.find(record[100:164])
        assert at > 0
        data[at] ^= 0xFF
    else:  # format 1 (no samples object) is checked too
        data += b"\0" * 4096
        if where == "format-1":
            (store / "samples.json.gz").unlink()
            (store / "manifest.json").write_text(
                dataclasses.replace(manifest, format_version=1, samples=None).to_json())
    shard.write_bytes(bytes(data))
    r = cli("verify", store, "--quiet", "--workers", "1", "--json")
    assert r.exit_code == 1, r.output
    out = json.loads(r.output)
    assert [p["file"] for p in out["shard_problems"]] == [str(shard)]
    assert "the file changed after its manifest was written" in out["shard_problems"][0]["problem"]
    assert bool(out["failures"]) == (where == "record"), out["failures"]
    r = cli("verify", store, "--quiet", "--workers", "1")
    assert f"{shard}: " in r.output and "shard files that differ from the manifest: 1" in r.output, r.output
