"""The --max-side advice: what it samples, what it measures against, and when it stays quiet."""

from __future__ import annotations

import pytest

from fastload.image.policy import DEFAULT_MAX_PIXELS, prepare
from fastload.measure import advice as advice_mod
from fastload.measure.advice import MaxSideAdvice, max_side_advice, recommended_max_side


def test_recommended_max_side_is_twice_the_training_size():
    assert recommended_max_side(224) == 448 and recommended_max_side(160) == 320


def test_small_images_are_not_measured(tiny_store):
    a = max_side_advice(tiny_store, size=224)
    assert a.speedup is None and a.rounds == 0 and not a.worthwhile
    assert 48 <= a.median_long_side <= 160 and a.sampled == 8
    assert "no reduction advised" in a.message()


def test_large_images_are_timed_against_what_convert_would_store(tiny_store, monkeypatch):
    """The reduced records are exactly ``prepare(data, max_side=M)``: the same call convert makes."""
    seen = []
    real = prepare

    def spy(data, **kw):
        out = real(data, **kw)
        seen.append((kw, out))
        return out

    monkeypatch.setattr("fastload.image.policy.prepare", spy)
    a = max_side_advice(tiny_store, size=16, sample=5, rounds=2)
    assert len(seen) == 5
    assert all(kw == {"max_side": 32, "encoding": "jpeg", "max_pixels": DEFAULT_MAX_PIXELS} for kw, _ in seen)
    assert all(max(out.width, out.height) <= 32 for _, out in seen)
    assert a.sampled == 5 and a.rounds == 2 and a.max_side == 32
    assert a.ms_stored > 0 and a.ms_reduced > 0 and a.speedup == pytest.approx(a.ms_stored / a.ms_reduced, rel=0.03)
    assert a.bytes_ratio == pytest.approx(sum(len(o.data) for _, o in seen) / _stored_bytes(tiny_store, a), rel=1e-3)


def _stored_bytes(store, a: MaxSideAdvice) -> int:
    import numpy as np

    from fastload.load.dataset import LMDBImageDataset

    ds = LMDBImageDataset(store)
    pick = np.random.default_rng(0).choice(len(ds), size=a.sampled, replace=False)
    return sum(len(ds.get_bytes(int(i))) for i in pick)


def test_message_gives_the_command_only_when_worthwhile():
    base = dict(store="s", size=224, sampled=8, median_long_side=4000, max_side=448, ms_stored=50.0,
                bytes_ratio=0.02, rounds=3)
    good = MaxSideAdvice(**base, speedup=25.0, ms_reduced=2.0)
    assert "25.0x faster" in good.message("/data/src") and "HINT: fastload convert /data/src DST --max-side 448" in \
        good.message("/data/src")
    poor = MaxSideAdvice(**base, speedup=advice_mod.WORTHWHILE - 0.1, ms_reduced=40.0)
    assert "HINT" not in poor.message() and "not worth a reduced store" in poor.message()


def test_small_images_need_no_torch(tiny_store):
    """inspect's default advice on a store of small images reads headers only: torch is not imported."""
    import subprocess
    import sys

    code = ("import sys; from fastload.measure.advice import max_side_advice; "
            f"a = max_side_advice({str(tiny_store)!r}); print(a.speedup, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "False"]


def test_a_failing_measurement_is_one_line_and_the_command_succeeds(tiny_tree, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from fastload.cli import main

    def boom(*a, **k):
        raise RuntimeError("no luck")

    monkeypatch.setattr(advice_mod, "max_side_advice", boom)
    r = CliRunner().invoke(main, ["convert", str(tiny_tree), str(tmp_path / "s"), "-q", "--workers", "2"])
    assert r.exit_code == 0 and "--max-side advice not measured: RuntimeError: no luck" in r.output
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "s")])
    assert r.exit_code == 0 and "size      --max-side advice not measured: RuntimeError: no luck" in r.output
    r = CliRunner().invoke(main, ["convert", str(tiny_tree), str(tmp_path / "s"), "-q"])
    assert "already complete" in r.output and "advice" not in r.output  # nothing new to advise on


def test_bad_arguments_are_refused(tiny_store):
    with pytest.raises(ValueError):
        max_side_advice(tiny_store, size=4)
