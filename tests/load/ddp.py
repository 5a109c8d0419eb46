"""The one torchrun runner of the distributed tests: a script of tests/load/ under
``torch.distributed.run --standalone`` (gloo on CPU), and the JSON each rank wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def torchrun(script: str, nproc: int, *args, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``tests/load/SCRIPT`` on ``nproc`` ranks; with ``check``, fail the test on a non-zero exit,
    quoting the ranks' error lines (or the end of stderr)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(HERE / script), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check:
        errors = [line for line in proc.stderr.splitlines() if "Error" in line and "gloo" not in line]
        assert proc.returncode == 0, "\n".join(errors[:20]) or proc.stderr[-3000:]
    return proc


def rank_records(out: Path, nproc: int, name: str = "rank{r}.json") -> list[dict]:
    """The JSON record each rank wrote to ``out / name.format(r=rank)``."""
    return [json.loads((out / name.format(r=r)).read_text()) for r in range(nproc)]
