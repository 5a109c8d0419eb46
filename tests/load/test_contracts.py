"""The preset contract and the skip policy are written once, and every reader uses them."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from fastload.errors import CorruptSampleError, TooManyCorruptSamplesError
from fastload.load.skips import MAX_CONSECUTIVE_SKIPS, check_on_error, record_skip
from fastload.load.transforms import Preset, eval_transform, is_preset, preset_size, train_transform

PACKAGE = Path(__file__).resolve().parent.parent.parent / "fastload"


class OwnPreset:
    """A user's preset: only the contract's method."""

    def from_bytes(self, data: bytes, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.zeros(3, 2, 2, dtype=torch.uint8)


def test_fastloads_presets_and_a_users_follow_the_contract():
    for preset in (train_transform(32), eval_transform(32, 36), OwnPreset()):
        assert is_preset(preset) and isinstance(preset, Preset)
    for other in (None, lambda img: img, "from_bytes"):
        assert not is_preset(other)
    assert preset_size(train_transform(32)) == 32 and preset_size(OwnPreset()) is None


def test_the_crop_box_is_the_one_from_bytes_draws():
    preset = train_transform(16)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert preset.crop_box(100, 80, g1) == preset._rrc(100, 80, g2)


def _sources():
    return [(p, p.read_text()) for p in PACKAGE.rglob("*.py")]


def test_no_module_tests_for_a_preset_its_own_way():
    """``is_preset`` is the one test: no ``getattr(x, "from_bytes")`` outside transforms.py."""
    found = [str(p.relative_to(PACKAGE)) for p, text in _sources()
             if p.name != "transforms.py" and re.search(r"getattr\([^)]*[\"']from_bytes[\"']", text)]
    assert not found, found


def test_no_module_reads_a_presets_private_attributes():
    found = [f"{p.relative_to(PACKAGE)}: {m}" for p, text in _sources() if p.name != "transforms.py"
             for m in re.findall(r"\b(?:preset|transform|tf)\._\w+", text)]
    assert not found, found


def test_on_error_values_are_checked_once():
    check_on_error("raise")
    check_on_error("skip")
    with pytest.raises(ValueError, match="Unknown value 'ignore' for argument on_error"):
        check_on_error("ignore")


def test_a_skip_is_logged_and_a_run_past_the_bound_raises(caplog):
    exc = CorruptSampleError("store.lmdb: sample 7 (a/b.jpg) failed to decode")
    with caplog.at_level(logging.WARNING, logger="fastload"):
        record_skip("store.lmdb", exc, skipped=3, run=MAX_CONSECUTIVE_SKIPS, where="from index 7")
    assert "skipping store.lmdb: sample 7 (a/b.jpg)" in caplog.text and "skipped 3 so far" in caplog.text
    with pytest.raises(TooManyCorruptSamplesError, match="21 consecutive samples failed from index 0 .*in a row"):
        record_skip("store.lmdb", exc, skipped=21, run=MAX_CONSECUTIVE_SKIPS + 1, where="from index 0")


def test_every_reader_uses_the_one_skip_policy():
    own_bound = [str(p.relative_to(PACKAGE)) for p, text in _sources()
                 if p.name != "skips.py" and re.search(r"MAX_CONSECUTIVE_SKIPS\s*=|\"raise\", \"skip\"\)", text)]
    assert not own_bound, own_bound
    for reader in ("load/dataset.py", "load/dali.py"):
        text = (PACKAGE / reader).read_text()
        assert "check_on_error(" in text and "record_skip(" in text, reader
