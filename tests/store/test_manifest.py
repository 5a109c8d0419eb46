"""store/manifest.py: the manifest's JSON round trip and a named error for each bad field."""

from __future__ import annotations

import json

import pytest

from fastload.errors import ManifestError
from fastload.store.manifest import MANIFEST_VERSION, Manifest, ShardEntry, parse_samples, samples_object

SHA = "ab" * 32
LABELS = [0, 1, 1, 0, 1, 0, 0, 1]
PATHS = [f"{'cat' if y == 0 else 'dog'}/{i}.jpg" for i, y in enumerate(LABELS)]


def _manifest() -> Manifest:
    shards = (ShardEntry("shard-00000-of-00003", 0, 5, 1000, SHA), ShardEntry("shard-00001-of-00003", 5, 0, 100, SHA),
              ShardEntry("shard-00002-of-00003", 5, 3, 900, SHA))
    return Manifest(MANIFEST_VERSION, shards, ("cat", "dog"), 8, {"shuffle": False}, {"stored": 8, "skipped": []},
                    samples_object(LABELS, PATHS)[1])


def test_round_trip_and_locate():
    m = _manifest()
    assert Manifest.from_json(m.to_json()) == m
    assert [m.locate(i) for i in (0, 4, 5, 7)] == [(0, 0), (0, 4), (2, 0), (2, 2)]
    with pytest.raises(IndexError):
        m.locate(8)


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.pop("shards"), "'shards' is missing"),
    (lambda d: d.update(num_samples="8"), "'num_samples' must be int"),
    (lambda d: d.update(num_samples=9), "num_samples is 9 but the shards hold 8"),
    (lambda d: d["shards"][2].update(start=6), "shards[2].start is 6, expected 5"),
    (lambda d: d["shards"][0].update(sha256="XYZ"), "shards[0].sha256"),
    (lambda d: d["shards"][1].update(name="../evil"), "shards[1].name"),
    (lambda d: d["shards"][1].pop("bytes"), "'shards[1].bytes' is missing"),
    (lambda d: d.update(classes=[1, 2]), "'classes' must be a list of strings"),
    (lambda d: d.update(format_version=MANIFEST_VERSION + 1), "format_version"),
    (lambda d: d.pop("samples"), "'samples' is missing"),
    (lambda d: d["samples"].update(sha256="0" * 63), "samples.sha256"),
    (lambda d: d["samples"].update(name="../labels.json.gz"), "samples.name"),
    (lambda d: d["samples"].update(count=7), "samples has"),
    (lambda d: d["samples"].update(bytes="12"), "'samples.bytes' must be int"),
    (lambda d: d.update(format_version=1), "'samples' is not part of format_version 1"),
])
def test_bad_field_is_named(edit, field):
    d = json.loads(_manifest().to_json())
    edit(d)
    with pytest.raises(ManifestError) as err:
        Manifest.from_json(json.dumps(d), where="s3://b/store/manifest.json")
    message = str(err.value)
    assert field in message and message.startswith("s3://b/store/manifest.json") and "HINT" in message


def test_format_1_reads_without_samples():
    d = json.loads(_manifest().to_json())
    d.pop("samples")
    d["format_version"] = 1
    m = Manifest.from_json(json.dumps(d))
    assert m.format_version == 1 and m.samples is None and m.num_samples == 8


def test_samples_object_is_deterministic_and_checked():
    data, entry = samples_object(LABELS, PATHS)
    assert samples_object(list(LABELS), list(PATHS))[0] == data  # no timestamp, no name: same bytes
    m = _manifest()
    assert entry == m.samples and parse_samples(data, m) == (LABELS, PATHS)
    tampered = samples_object([1 - y for y in LABELS], PATHS)[0]
    with pytest.raises(ManifestError, match="sha256") as err:
        parse_samples(tampered, m, where="s3://b/store/samples.json.gz")
    assert str(err.value).startswith("s3://b/store/samples.json.gz") and "HINT" in str(err.value)
    short, short_entry = samples_object(LABELS[:7], PATHS[:7])  # its own sha256, but 7 samples for 8
    with pytest.raises(ManifestError, match="8 labels and paths"):
        parse_samples(short, Manifest(MANIFEST_VERSION, m.shards, m.classes, 8, {}, {},
                                      type(short_entry)(short_entry.name, short_entry.bytes, short_entry.sha256, 8)))
    outside, outside_entry = samples_object([0, 1, 2, 0, 1, 0, 0, 1], PATHS)
    with pytest.raises(ManifestError, match="outside 0..1"):
        parse_samples(outside, Manifest(MANIFEST_VERSION, m.shards, m.classes, 8, {}, {}, outside_entry))


def test_not_json_is_named():
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.from_json(b"{trunc", where="x")


def test_sharded_store_without_manifest_is_incomplete(tiny_store, tmp_path):
    import shutil

    from fastload.errors import IncompleteStoreError
    from fastload.store.reader import StoreReader

    dst = tmp_path / "dst"
    shutil.copytree(tiny_store, dst / "shard-00000-of-00001", ignore=shutil.ignore_patterns("lock.mdb", ".*"))
    (dst / "plan.json").write_text("{}")
    with pytest.raises(IncompleteStoreError, match="no manifest.json"):
        StoreReader(dst)
    (dst / "manifest.json").write_text("{}")
    assert len(StoreReader(dst)) == 24


def _gzip_stream(parts) -> bytes:
    import zlib

    z = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return b"".join([*(z.compress(p) for p in parts), z.flush()])


def test_a_samples_object_that_inflates_past_what_its_samples_can_take_is_refused_unread():
    """A small object that inflates to far more than 8 samples' labels and paths can take (here 100 MB in
    one path; a 1.6 MB object made a reader resident at 3.6 GB) is refused, without inflating it whole."""
    import hashlib
    import tracemalloc

    from fastload.store.manifest import SAMPLES_NAME, SamplesEntry, samples_limit

    head = b'{"labels":[0,1,0,1,0,1,0,1],"paths":["' + b'","'.join(p.encode() for p in PATHS[:7]) + b'","'
    bomb = _gzip_stream([head, *(b"a" * (1 << 20) for _ in range(100)), b'"]}'])
    assert len(bomb) < 200_000
    m = _manifest()
    m = Manifest(MANIFEST_VERSION, m.shards, m.classes, 8, {}, {},
                 SamplesEntry(SAMPLES_NAME, len(bomb), hashlib.sha256(bomb).hexdigest(), 8))
    tracemalloc.start()
    try:
        with pytest.raises(ManifestError, match=r"inflates to more than [\d,]+ bytes, the most 8 samples"):
            parse_samples(bomb, m, where="s3://b/store/samples.json.gz")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * samples_limit(8, 2) + (1 << 20)  # not the 100 MB the object inflates to
    # the bound leaves room for any real store: 8 paths of PATH_MAX bytes, each escaped at worst
    worst = ["\x01" * 4096] * 8
    data, entry = samples_object(LABELS, worst)
    assert parse_samples(data, Manifest(MANIFEST_VERSION, m.shards, m.classes, 8, {}, {}, entry))[1] == worst
