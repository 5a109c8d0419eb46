"""Issue #21's header-flood probe against a real `fastload serve` process: RSS growth and the answer.

Two connections each send a request line and then 200 MB of one never-ending header field.
Prints each connection's answer status (-1: none), the server's RSS before, its peak growth
during the flood, and its growth one second after.

    PYTHONPATH=$PWD python tools/serve_header_flood.py asgi     # or stdlib
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "serve"), str(ROOT / "tests")]

from serving import ServeProcess, rss_bytes  # noqa: E402
from test_front_probes import _flood  # noqa: E402


def main(front: str, megabytes: int = 200) -> None:
    proc = ServeProcess("--model", "simulated", "--batch-ms", "2", "--devices", "cpu", "--size", "32",
                        "--resize", "40", "--front", front, "--header-timeout", "60")
    try:
        time.sleep(1)
        before = rss_bytes(proc.pid)
        answers: list[int] = []
        peak = [before]
        floods = [threading.Thread(target=_flood, args=(proc.port, b"a" * 65536, megabytes << 20, answers))
                  for _ in range(2)]
        t0 = time.monotonic()
        for t in floods:
            t.start()
        while any(t.is_alive() for t in floods):
            peak.append(rss_bytes(proc.pid))
            time.sleep(0.05)
        took = time.monotonic() - t0
        time.sleep(1)
        after = rss_bytes(proc.pid)
        print(f"{front}: answers {answers}, RSS before {before >> 20} MB, peak +{(max(peak) - before) >> 20} MB, "
              f"after +{(after - before) >> 20} MB, flood over in {took:.1f}s")
    finally:
        proc.terminate()
        proc.kill()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "asgi")
