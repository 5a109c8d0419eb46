"""#17: every decoder of the fast path is safe to call from many threads at once.

The hammering runs in a subprocess (thread_safety_check.py) so that a crash — the heap
corruption and segfaults a shared nvImageCodec decoder caused — fails this test instead of
killing the suite.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

N_IMAGES = 200


def make_jpegs(folder: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    folder.mkdir()
    for k in range(n):
        w, h = int(rng.integers(64, 260)), int(rng.integers(64, 260))
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 / w, y * 255 / h, (x * y) % 256], -1)
        arr = np.clip(base + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8)
        subsampling = int(rng.integers(0, 3))  # 4:4:4, 4:2:2, 4:2:0
        Image.fromarray(arr, "RGB").save(folder / f"{k:04d}.jpg", "JPEG", quality=int(rng.integers(60, 96)),
                                         subsampling=subsampling)


@pytest.mark.parametrize("turbo", [True, False], ids=["compiled", "without-compiled"])
def test_decoders_from_four_threads_match_single_threaded(tmp_path, turbo):
    built = importlib.util.find_spec("fastload.image._jpeg") is not None
    if turbo and not built:
        pytest.skip("fastload was installed without its compiled region decoder (fastload/image/_jpeg.c)")
    make_jpegs(tmp_path / "jpegs", N_IMAGES)
    script = Path(__file__).with_name("thread_safety_check.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "jpegs")] + ([] if turbo else ["no-turbo"]),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"crashed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["images"] == N_IMAGES and result["threads"] == 4
    names = ["decode_rgb_region", "decode_rgb_fast", "decode_rgb_fast/full", "from_bytes(224)", "from_bytes(48)"]
    assert result["counts"] == {name: 2 * N_IMAGES for name in names}
    assert result["mismatches"] == {}
    if turbo:
        assert result["backend"] == "libjpeg-turbo"
    elif importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.nvimgcodec") is not None:
        # region decodes really went through nvImageCodec, on every thread: none fell back
        assert result["backend"] == "nvimgcodec-cpu"
        assert result["region_fallbacks_single"] == 0 and result["region_fallbacks_total"] == 0
    else:
        assert result["backend"] == "simplejpeg"
