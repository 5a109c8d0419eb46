"""Run in a subprocess by test_thread_safety.py: decode every JPEG of a folder single-threaded, then
from 4 threads at once (several shuffled passes), and report every output that differs.

``no-turbo`` after the folder: as if the compiled region decoder (fastload/image/_jpeg.c) was not built.
Prints one JSON line: counts of calls and mismatches per function, the region backend and the
region-decode fallbacks. A crash (segfault, heap corruption abort) ends the process instead.
"""

import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from fastload.image.fast import decode_rgb_fast, decode_rgb_region, fallback_counts, image_size, jpeg_backend
from fastload.load.transforms import train_transform

THREADS, PASSES = 4, 2
BIG, SMALL = train_transform(224), train_transform(48)  # region-decode path, DCT-scaled path


def jobs(data: list[bytes]):
    """(name, index, call) for every check: each call is deterministic given its index."""
    out = []
    for k, d in enumerate(data):
        h, w = image_size(d)
        rng = random.Random(k)
        top, left = rng.randrange(h // 2), rng.randrange(w // 2)
        rh, rw = rng.randint(1, h - top), rng.randint(1, w - left)
        out.append(("decode_rgb_region", k, lambda d=d, b=(top, left, rh, rw): decode_rgb_region(d, *b)))
        out.append(("decode_rgb_fast", k, lambda d=d, m=(h // 3, w // 3): decode_rgb_fast(d, min_height=m[0],
                                                                                       min_width=m[1])))
        out.append(("decode_rgb_fast/full", k, lambda d=d: decode_rgb_fast(d)))
        for name, t in (("from_bytes(224)", BIG), ("from_bytes(48)", SMALL)):
            out.append((name, k, lambda d=d, t=t, k=k: t.from_bytes(d, generator=torch.Generator().manual_seed(k))))
    return out


def as_array(x) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def main(folder: str) -> None:
    data = [p.read_bytes() for p in sorted(Path(folder).glob("*.jpg"))]
    todo = jobs(data)
    reference = {(name, k): as_array(call()).copy() for name, k, call in todo}
    region_fallbacks_single = fallback_counts()["region"]
    counts: dict[str, int] = {}
    mismatches: dict[str, list[int]] = {}

    def check(job):
        name, k, call = job
        return name, k, np.array_equal(as_array(call()), reference[(name, k)])

    with ThreadPoolExecutor(THREADS) as pool:
        for p in range(PASSES):
            order = todo[:]
            random.Random(100 + p).shuffle(order)
            for name, k, same in pool.map(check, order):
                counts[name] = counts.get(name, 0) + 1
                if not same:
                    mismatches.setdefault(name, []).append(k)
    print(json.dumps({"images": len(data), "threads": THREADS, "counts": counts, "mismatches": mismatches,
                      "backend": jpeg_backend(), "region_fallbacks_single": region_fallbacks_single,
                      "region_fallbacks_total": fallback_counts()["region"]}))


if __name__ == "__main__":
    if sys.argv[2:] == ["no-turbo"]:  # as installed without the compiled decoder: nvImageCodec's path
        import fastload.image.fast

        fastload.image.fast._TURBO = None
    main(sys.argv[1])
