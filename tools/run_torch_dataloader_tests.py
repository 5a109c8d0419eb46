#!/usr/bin/env python
"""Run PyTorch's own DataLoader test suite against ``fastload.DataLoader``.

PyTorch's tests are not in its wheels, so bring ``test/test_dataloader.py`` from the
PyTorch source of your torch version. This script copies it to a temporary folder with
``torch.utils.data.DataLoader`` replaced by ``fastload.DataLoader`` (in every process the
tests start, spawned ones included, because the replacement is at the top of the copied
module), runs it with pytest, then runs the unmodified file as the baseline, and reports
tests that pass with torch's DataLoader but not with ours.

    python tools/run_torch_dataloader_tests.py path/to/test_dataloader.py [-k EXPR] [--only fastload|torch]

Needs ``pip install expecttest psutil`` (torch.testing's own dependencies). Exits 1 when a
test passes with torch's DataLoader and fails with fastload's.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

PATCH = '''
# --- inserted by fastload/tools/run_torch_dataloader_tests.py ---
import torch.utils.data as _fastload_tud
import torch.utils.data.dataloader as _fastload_tudl
from fastload.load.loader import DataLoader as _FastloadDataLoader
_fastload_tud.DataLoader = _FastloadDataLoader
_fastload_tudl.DataLoader = _FastloadDataLoader
# --- end of insertion ---
'''


def prepare(src: Path, folder: Path, patched: bool) -> Path:
    text = src.read_text()
    if patched:
        lines = text.splitlines(keepends=True)
        head = 0
        while head < len(lines) and lines[head].startswith("#"):
            head += 1  # keep the header comments first
        text = "".join(lines[:head]) + PATCH + "".join(lines[head:])
    dst = folder / "test_dataloader.py"
    dst.write_text(text)
    return dst


def run(src: Path, patched: bool, extra: list[str]) -> dict[str, str]:
    with tempfile.TemporaryDirectory(prefix="torch-dl-tests-") as tmp:
        folder = Path(tmp)
        test = prepare(src, folder, patched)
        junit = folder / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", str(test), "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               "-o", "filterwarnings=", f"--junitxml={junit}", "--timeout=900", *extra]
        subprocess.run(cmd, cwd=folder, check=False)
        outcomes = {}
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname', '').split('.')[-1]}.{case.get('name')}"
            state = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    state = "failed"
                elif child.tag == "skipped":
                    state = "skipped"
            outcomes[name] = state
        return outcomes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("test_file", type=Path, help="test/test_dataloader.py from PyTorch's source")
    ap.add_argument("--only", choices=["fastload", "torch"], help="run one side only")
    ap.add_argument("-k", default=None, help="pytest -k expression")
    args = ap.parse_args()
    extra = ["-k", args.k] if args.k else []
    results = {}
    for side in ("fastload", "torch"):
        if args.only in (None, side):
            print(f"\n=== PyTorch DataLoader tests with {side}'s DataLoader ===", flush=True)
            results[side] = run(args.test_file, side == "fastload", extra)
    for side, res in results.items():
        counts = {s: sum(1 for v in res.values() if v == s) for s in ("passed", "failed", "skipped")}
        print(f"{side}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    if len(results) == 2:
        regressions = sorted(n for n, s in results["fastload"].items()
                             if s == "failed" and results["torch"].get(n) == "passed")
        both = sorted(n for n, s in results["fastload"].items()
                      if s == "failed" and results["torch"].get(n) == "failed")
        for n in regressions:
            print(f"REGRESSION (passes with torch, fails with fastload): {n}")
        for n in both:
            print(f"fails with both (not a fastload difference): {n}")
        return 1 if regressions else 0
    return 1 if any(v == "failed" for v in next(iter(results.values())).values()) else 0


if __name__ == "__main__":
    sys.exit(main())
