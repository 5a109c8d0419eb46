"""Hostile inputs at conversion: odd names, special files, huge files, links, DST inside SRC,
broken file lists, two writers. Each ends in a clear error or a skip with a reason, and
nothing already committed is lost."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from fastload.cli import main
from fastload.errors import SourceError, StoreLockedError
from fastload.load.dataset import LMDBImageDataset
from fastload.pack.convert import ConvertOptions, convert
from fastload.store.writer import LOCK_NAME
from helpers import jpeg_bytes, photo

QUIET = dict(progress=False, workers=2)


def small_tree(root: Path, n: int = 3) -> Path:
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True)
        for i in range(n):
            (root / c / f"{i}.jpg").write_bytes(jpeg_bytes(photo(40, 30, seed=i + 10 * len(c))))
    return root


def skipped(report) -> dict[str, str]:
    return {s["relpath"]: s["reason"] for s in report.skipped}


def test_non_utf8_file_name_is_stored_faithfully(tmp_path):
    tree = small_tree(tmp_path / "t")
    name = os.fsdecode(b"caf\xe9.jpg")
    (tree / "cat" / name).write_bytes(jpeg_bytes(photo(30, 30, seed=99)))
    report = convert(tree, tmp_path / "out", ConvertOptions(**QUIET))
    assert report.stored == 7 and not report.skipped
    ds = LMDBImageDataset(tmp_path / "out")
    rels = [os.fsencode(r) for r, _ in ds.samples]
    assert b"cat/caf\xe9.jpg" in rels
    r = CliRunner().invoke(main, ["convert", str(tree), str(tmp_path / "out2"), "--quiet", "--workers", "1"])
    assert r.exit_code == 0, r.output


@pytest.mark.timeout(60)
def test_fifo_named_like_an_image_is_skipped_not_waited_on(tmp_path):
    tree = small_tree(tmp_path / "t")
    os.mkfifo(tree / "cat" / "x.jpg")
    report = convert(tree, tmp_path / "out", ConvertOptions(**QUIET))
    assert "FIFO" in skipped(report)["cat/x.jpg"] and report.stored == 6


def test_file_over_the_size_cap_is_skipped_unread(tmp_path):
    tree = small_tree(tmp_path / "t")
    with open(tree / "dog" / "huge.jpg", "wb") as f:  # sparse: 3 GB on paper, nothing on disk
        f.truncate(3 << 30)
    report = convert(tree, tmp_path / "out", ConvertOptions(**QUIET))
    assert "over the limit of 1,073,741,824" in skipped(report)["dog/huge.jpg"]
    report = convert(tree, tmp_path / "small", ConvertOptions(max_file_bytes=1000, **QUIET))
    assert all("over the limit" in why for why in skipped(report).values()) and report.stored == 0


def test_link_to_dev_zero_is_skipped_with_or_without_follow(tmp_path):
    tree = small_tree(tmp_path / "t")
    os.symlink("/dev/zero", tree / "cat" / "zero.jpg")
    outside = tmp_path / "elsewhere.jpg"
    outside.write_bytes(jpeg_bytes(photo(20, 20)))
    os.symlink(outside, tree / "cat" / "outside.jpg")
    os.symlink(tree / "dog" / "0.jpg", tree / "cat" / "inside.jpg")
    report = convert(tree, tmp_path / "a", ConvertOptions(**QUIET))
    why = skipped(report)
    assert "outside the source" in why["cat/zero.jpg"] and "--follow-symlinks" in why["cat/outside.jpg"]
    assert "cat/inside.jpg" not in why  # a link within the source is read
    report = convert(tree, tmp_path / "b", ConvertOptions(follow_symlinks=True, **QUIET))
    why = skipped(report)
    assert "not a regular file (a device)" in why["cat/zero.jpg"] and "cat/outside.jpg" not in why


def test_directory_link_loop_is_walked_once(tmp_path):
    tree = small_tree(tmp_path / "t")
    os.symlink(tree / "cat", tree / "cat" / "loop")
    report = convert(tree, tmp_path / "out", ConvertOptions(**QUIET))
    assert report.stored == 6


def test_dst_inside_src_is_left_out_and_resumes(tmp_path):
    from fastload.store.writer import StoreWriter

    tree = small_tree(tmp_path / "t", n=5)
    dst = tree / "packed.lmdb"
    real = StoreWriter.commit_chunk
    calls = {"n": 0}

    def crash_after_one(self, chunk, samples, **kw):
        if calls["n"] == 1:
            raise KeyboardInterrupt
        calls["n"] += 1
        return real(self, chunk, samples, **kw)

    StoreWriter.commit_chunk = crash_after_one
    try:
        with pytest.raises(KeyboardInterrupt):
            convert(tree, dst, ConvertOptions(chunk_size=3, **QUIET))
    finally:
        StoreWriter.commit_chunk = real
    report = convert(tree, dst, ConvertOptions(chunk_size=3, **QUIET))
    assert report.resumed_from == 3 and report.stored == 10
    assert LMDBImageDataset(dst).classes == ["cat", "dog"]
    assert convert(tree, dst, ConvertOptions(chunk_size=3, **QUIET)).already_complete


# ---- file lists ----------------------------------------------------------------------------------


def write_list(tmp_path: Path, lines: list[str], *, encoding: str = "utf-8", name: str = "list.csv") -> Path:
    small_tree(tmp_path / "t")
    p = tmp_path / name
    p.write_bytes("\n".join(lines).encode(encoding))
    return p


def test_latin1_list_is_an_error_naming_the_line(tmp_path):
    p = write_list(tmp_path, ["t/cat/0.jpg,cat", "t/dog/0.jpg,chien é"], encoding="latin-1")
    with pytest.raises(SourceError, match=r"list.csv:2: not valid UTF-8"):
        convert(p, tmp_path / "out", ConvertOptions(**QUIET))


def test_utf16_list_is_a_clear_error(tmp_path):
    p = write_list(tmp_path, ["\ufefft/cat/0.jpg,cat"], encoding="utf-16-le")
    p.write_bytes(b"\xff\xfe" + p.read_bytes()[2:])
    with pytest.raises(SourceError, match="UTF-16"):
        convert(p, tmp_path / "out", ConvertOptions(**QUIET))


def test_utf8_bom_is_accepted(tmp_path):
    p = write_list(tmp_path, ["\ufeffpath,label", "t/cat/0.jpg,cat", "t/dog/0.jpg,dog"])
    assert convert(p, tmp_path / "out", ConvertOptions(**QUIET)).stored == 2


def test_label_far_outside_is_an_error_naming_the_line_quickly(tmp_path):
    p = write_list(tmp_path, ["t/cat/0.jpg,0", "t/dog/0.jpg,1", "t/dog/1.jpg,1000000000"])
    t0 = time.perf_counter()
    with pytest.raises(SourceError, match=r"list.csv:3: label 1000000000 is outside 0\.\.2 \(3 distinct labels\)"):
        convert(p, tmp_path / "out", ConvertOptions(**QUIET))
    assert time.perf_counter() - t0 < 10  # not a billion class names


def test_integer_label_gaps_are_reported(tmp_path):
    p = write_list(tmp_path, ["t/cat/0.jpg,0", "t/dog/0.jpg,3"])
    report = convert(p, tmp_path / "out", ConvertOptions(**QUIET))
    assert any("2 of 4 integer classes have no sample: 1, 2" in w for w in report.warnings)


def test_num_classes_bounds_integer_labels(tmp_path):
    p = write_list(tmp_path, ["t/cat/0.jpg,0", "t/dog/0.jpg,7"])
    with pytest.raises(SourceError, match=r"label 7 is outside 0\.\.4 \(--num-classes 5\)"):
        convert(p, tmp_path / "out", ConvertOptions(num_classes=5, **QUIET))
    assert LMDBImageDataset(convert(p, tmp_path / "ok", ConvertOptions(num_classes=10, **QUIET)).dst).classes[9] == "9"


def test_class_names_with_one_sample_are_listed_as_likely_typos(tmp_path):
    lines = [f"t/cat/{i}.jpg,cat" for i in range(3)] + ["t/dog/0.jpg,dog", "t/dog/1.jpg,dog", "t/dog/2.jpg,dgo"]
    report = convert(write_list(tmp_path, lines), tmp_path / "out", ConvertOptions(**QUIET))
    assert any("single sample" in w and "'dgo'" in w for w in report.warnings)


def test_same_path_twice_with_two_labels_is_an_error_naming_both_lines(tmp_path):
    p = write_list(tmp_path, ["t/cat/0.jpg,cat", "t/dog/0.jpg,dog", "t/cat/0.jpg,dog"])
    with pytest.raises(SourceError, match=r"list.csv:3: .*\(line 1: cat, line 3: dog\)"):
        convert(p, tmp_path / "out", ConvertOptions(**QUIET))
    p = write_list(tmp_path / "b", ["t/cat/0.jpg,cat", "t/cat/0.jpg,cat", "t/dog/0.jpg,dog"])
    assert any("listed more than once" in w for w in convert(p, tmp_path / "o2", ConvertOptions(**QUIET)).warnings)


# ---- one writer at a time --------------------------------------------------------------------------

_SLOW = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[3])
    import fastload.pack.convert as conv
    from fastload.pack.convert import ConvertOptions, convert
    conv._HANDLER = "slow_handler:prepare_item"
    convert(sys.argv[1], sys.argv[2], ConvertOptions(progress=False, workers=1, chunk_size=2))
    print("done")
""")


def test_second_conversion_into_one_destination_is_refused_at_once(tmp_path):
    tree = small_tree(tmp_path / "t", n=6)
    (tmp_path / "slow_handler.py").write_text(textwrap.dedent("""
        import time
        from fastload.pack.work import prepare_item as real
        def prepare_item(path, options):
            time.sleep(0.3)
            return real(path, options)
    """))
    dst = tmp_path / "out"
    first = subprocess.Popen([sys.executable, "-c", _SLOW, str(tree), str(dst), str(tmp_path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not ((dst / LOCK_NAME).exists() and (dst / LOCK_NAME).read_text()):
            time.sleep(0.05)
        t0 = time.perf_counter()
        second = subprocess.run([sys.executable, "-m", "fastload.cli", "convert", str(tree), str(dst), "--quiet"],
                                capture_output=True, text=True, timeout=60)
        assert time.perf_counter() - t0 < 30
        assert second.returncode == 1
        assert f"being written by another conversion (pid {first.pid} on" in second.stderr
        out, err = first.communicate(timeout=120)
        assert first.returncode == 0 and "done" in out, err
    finally:
        first.kill()
    assert LMDBImageDataset(dst).targets == [0] * 6 + [1] * 6
    assert (dst / LOCK_NAME).read_text() == ""  # released cleanly


def test_stale_lock_of_a_dead_process_is_taken_over_with_a_message(tmp_path, caplog):
    tree = small_tree(tmp_path / "t")
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / LOCK_NAME).write_text("pid 999999 on elsewhere, since 2026-01-01 00:00:00")
    with caplog.at_level("WARNING", logger="fastload"):
        report = convert(tree, dst, ConvertOptions(**QUIET))
    assert report.stored == 6
    assert "taking over the writer lock" in caplog.text and "pid 999999" in caplog.text


def test_lock_is_refused_in_process_too(tmp_path):
    from fastload.store.writer import StoreWriter

    dst = tmp_path / "out"
    with StoreWriter(dst, map_size=1 << 20):
        with pytest.raises(StoreLockedError, match=f"pid {os.getpid()}"):
            StoreWriter(dst, map_size=1 << 20)
