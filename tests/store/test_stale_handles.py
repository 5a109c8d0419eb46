"""The per-process handle cache lets go of stores deleted or replaced since they were opened.

A kept handle on a deleted store made py-lmdb refuse a NEW store whose data.mdb reused the freed
inode ("already open in this process"): seen in the full suite after benchmarks deleted their
temporary stores. Inode reuse itself cannot be forced, so these tests check the mechanism.
"""

from __future__ import annotations

import os
import shutil

from fastload.pack.convert import ConvertOptions, convert
from fastload.store import reader


def _store(tree, dst):
    convert(tree, dst, ConvertOptions(lossless=True, progress=False))
    return dst


def test_a_deleted_store_handle_is_dropped_before_the_next_open(tiny_tree, tmp_path):
    a, b = _store(tiny_tree, tmp_path / "a.lmdb"), _store(tiny_tree, tmp_path / "b.lmdb")
    reader.open_readonly(a)
    key = os.path.realpath(a)
    assert key in reader._ENVS
    shutil.rmtree(a)
    reader.open_readonly(b)  # a new open sweeps the handles of stores that are gone
    assert key not in reader._ENVS and os.path.realpath(b) in reader._ENVS
    reader.release(b)


def test_a_replaced_data_file_drops_the_handle(tiny_tree, tmp_path):
    a = _store(tiny_tree, tmp_path / "a.lmdb")
    reader.open_readonly(a)
    data = a / "data.mdb"
    copy = a / "copy.mdb"
    shutil.copyfile(data, copy)
    os.replace(copy, data)  # same path, another inode
    reader.forget_stale()
    assert os.path.realpath(a) not in reader._ENVS
