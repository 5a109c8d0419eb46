"""Run in a node of tests/netns.py: one epoch of a remote store, pausing after the first batch.

argv: URL CACHE_DIR OUT. After the first batch it writes OUT/started and waits for OUT/go (the test
changes the node's link meanwhile), then reads the rest of the epoch. OUT/result.json: the samples
read, the node's downloads before the pause and at the end, or the error (its type and text) and
the seconds from go to the error.
"""

import json
import sys
import time
from pathlib import Path

import torch

from fastload import DataLoader, LMDBImageDataset, ShardSampler, collate_uint8, eval_transform
from fastload.store.cache import node_downloads


def main(url, cache_dir, out):
    out = Path(out)
    ds = LMDBImageDataset(url, cache_dir=cache_dir, transform=eval_transform(32, 32))
    loader = DataLoader(ds, batch_size=2, sampler=ShardSampler(ds, seed=3, window=1), num_workers=0, collate_fn=collate_uint8,
                        generator=torch.Generator().manual_seed(3))
    seen, result = [], {}
    go = None
    try:
        for b, (_, labels) in enumerate(loader):
            seen += labels.tolist()
            if b == 0:
                result["downloads_before"] = len(node_downloads(cache_dir))
                (out / "started").touch()
                while not (out / "go").exists():
                    time.sleep(0.05)
                go = time.monotonic()
    except Exception as exc:  # the test reads the error's type and text
        result["error"] = {"type": type(exc).__name__, "text": str(exc), "after_go_s": time.monotonic() - go}
    result["seen"] = len(seen)
    result["downloads_after"] = len(node_downloads(cache_dir))
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
