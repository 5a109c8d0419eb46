#!/usr/bin/env python
"""Run torchdata's own StatefulDataLoader state tests against ``fastload.DataLoader``.

torchdata's tests are not in its wheels, so bring ``test/stateful_dataloader/test_state_dict.py``
from the pytorch/data source of your torchdata version (tag v0.11.0 for torchdata 0.11.0). This
script copies it to a temporary folder with ``StatefulDataLoader`` replaced by
``fastload.DataLoader`` (the import line of the copied module is rewritten, so every process the
tests start sees the replacement), runs it with pytest, then runs the unmodified file as the
baseline, and reports tests that pass with torchdata's StatefulDataLoader but not with ours.

    git --git-dir=<pytorch/data clone> show v0.11.0:test/stateful_dataloader/test_state_dict.py \\
        > /tmp/test_state_dict.py
    python tools/run_torchdata_state_tests.py /tmp/test_state_dict.py [-k EXPR] [--only fastload|torchdata]

Needs ``pip install parameterized expecttest psutil pytest-timeout`` (the suite's and
torch.testing's own dependencies). Tests that read torchdata's private state keys cannot apply to
fastload's state; they are listed in INTERNAL_KEYS with the reason, and docs/resume-compat.md
explains them; DIFFERENT lists the one test that expects an error fastload deliberately raises
otherwise. Exits 1 when any other test passes with torchdata and fails with fastload.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

IMPORT = "from torchdata.stateful_dataloader import Stateful, StatefulDataLoader"
PATCH = '''from torchdata.stateful_dataloader import Stateful
# --- inserted by fastload/tools/run_torchdata_state_tests.py ---
from fastload.load.loader import DataLoader as StatefulDataLoader
# --- end of insertion ---'''

# Tests that read torchdata's private state keys: fastload's state is its own typed format
# (fastload/load/state.py), so a key path of torchdata's state is not there to read.
_SNAP = "reads state['_snapshot']['_worker_snapshots']"
INTERNAL_KEYS: dict[str, str] = {
    "TestInitialState_shard0.test_initial_state": _SNAP + " (one entry per worker) before iter()",
    "TestInitialState_shard0.test_load_state_after_initial_state_dict": _SNAP + " before iter()",
    "TestDynamicStateIterableDataset_shard0.test": _SNAP + "['worker_0']['fetcher_state']['dataset_iter_state']",
    "TestDatasetIteratorStateDuplication_shard0.test": _SNAP + "[...]['dataset_state'] and, with "
                                                       "num_workers=0, state['fetcher_state']",
    "TestSingleIterCalled_shard0.test_inline_iter": "reads state['fetcher_state']['dataset_iter_state']",
    "TestSingleIterCalled_shard0.test_mp": _SNAP + "[...]['dataset_state']",
    "TestSingleIterCalled_shard0.test_mp_iter": _SNAP + "[...]['fetcher_state']['dataset_iter_state']",
    "TestOutOfOrderWithCheckpointing.test_out_of_order_iterable_ds_one_completed_worker":
        _SNAP + "['worker_0']['fetcher_state']['fetcher_ended']",
    "TestOutOfOrderWithCheckpointing.test_out_of_order_iterable_ds_no_completed_workers":
        _SNAP + "['worker_0']['fetcher_state']['fetcher_ended']",
}

# Tests that pass only with an error fastload deliberately does not raise (docs/resume-compat.md).
DIFFERENT: dict[str, str] = {
    "TestNumWorkersMismatch_shard3.test_num_workers_mismatch":
        "expects an AssertionError from iter(); fastload refuses the state in load_state_dict with a "
        "ResumeStateError naming num_workers (an AssertionError is a broken invariant, not a user error)",
}


def prepare(src: Path, folder: Path, patched: bool) -> Path:
    text = src.read_text()
    if patched:
        if IMPORT not in text:
            raise SystemExit(f"{src}: the line {IMPORT!r} is not there; is this test_state_dict.py?\n"
                             "HINT: take it from the pytorch/data tag matching your torchdata version")
        text = text.replace(IMPORT, PATCH, 1)
    dst = folder / "test_state_dict.py"
    dst.write_text(text)
    return dst


def run(src: Path, patched: bool, extra: list[str]) -> dict[str, str]:
    with tempfile.TemporaryDirectory(prefix="torchdata-state-tests-") as tmp:
        folder = Path(tmp)
        test = prepare(src, folder, patched)
        junit = folder / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", str(test), "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               "-o", "filterwarnings=", f"--junitxml={junit}", "--timeout=600", *extra]
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
    ap.add_argument("test_file", type=Path, help="test/stateful_dataloader/test_state_dict.py from pytorch/data")
    ap.add_argument("--only", choices=["fastload", "torchdata"], help="run one side only")
    ap.add_argument("-k", default=None, help="pytest -k expression")
    args = ap.parse_args()
    extra = ["-k", args.k] if args.k else []
    results = {}
    for side in ("fastload", "torchdata"):
        if args.only in (None, side):
            print(f"\n=== torchdata state tests with {side}'s DataLoader ===", flush=True)
            results[side] = run(args.test_file, side == "fastload", extra)
    for side, res in results.items():
        counts = {s: sum(1 for v in res.values() if v == s) for s in ("passed", "failed", "skipped")}
        print(f"{side}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    ours = results.get("fastload", {})
    internal = sorted(n for n, s in ours.items() if s == "failed" and n in INTERNAL_KEYS)
    for n in internal:
        print(f"reads torchdata's internal state (cannot apply): {n}: {INTERNAL_KEYS[n]}")
    theirs = results.get("torchdata")
    for n in sorted(n for n, s in ours.items() if s == "failed" and n in DIFFERENT):
        print(f"deliberate difference (documented): {n}: {DIFFERENT[n]}")
    failing = sorted(n for n, s in ours.items() if s == "failed" and n not in INTERNAL_KEYS and n not in DIFFERENT
                     and (theirs is None or theirs.get(n) == "passed"))
    for n in failing:
        print(f"REGRESSION (passes with torchdata, fails with fastload): {n}")
    if theirs is not None:
        for n in sorted(n for n, s in ours.items() if s == "failed" and theirs.get(n) == "failed"):
            print(f"fails with both (not a fastload difference): {n}")
    if ours:
        return 1 if failing else 0
    return 1 if any(v == "failed" for v in theirs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
