"""What a JPEG region decode costs by where the region lies, for each region decoder installed.

    python tools/region_cost.py STORE [--images 300] [--rounds 3]

A region decoder skips work outside the region, but which work depends on the decoder. For each
shape (the whole image, the top or bottom half, the left half, a 64 px square at the top left or
bottom right) and each of ``image.fast.region_backends()`` (the compiled libjpeg-turbo decoder,
nvImageCodec), the mean µs per image over the store's first ``--images`` JPEG records, one thread,
the best of ``--rounds`` (the backends alternate within each round). A decoder that skips the
columns outside a crop makes "left half" cost about what "top half" does; one that decodes whole
rows makes it cost the whole image.

Must not: be imported by the package (a tool, run by hand).
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("store")
    p.add_argument("--images", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    o = p.parse_args(argv)

    from fastload.image.fast import decode_rgb_region, image_size, region_backends
    from fastload.image.policy import is_jpeg
    from fastload.load.dataset import LMDBImageDataset

    ds = LMDBImageDataset(o.store)
    blobs = [b for b in (ds.get_bytes(k) for k in range(min(len(ds), o.images * 2))) if is_jpeg(b)][:o.images]
    sizes = [image_size(b) for b in blobs]
    shapes = {
        "whole image": lambda h, w: (0, 0, h, w),
        "top half": lambda h, w: (0, 0, h // 2, w),
        "bottom half": lambda h, w: (h - h // 2, 0, h // 2, w),
        "left half": lambda h, w: (0, 0, h, w // 2),
        "64 px, top left": lambda h, w: (0, 0, min(64, h), min(64, w)),
        "64 px, bottom right": lambda h, w: (max(0, h - 64), max(0, w - 64), min(64, h), min(64, w)),
    }
    backends = region_backends()
    if not backends:
        raise SystemExit("no region decoder here: build fastload with a C compiler and libjpeg headers, "
                         "or pip install 'fastload[fast]'")
    best = {(s, b): float("inf") for s in shapes for b in backends}
    for _ in range(o.rounds):
        for shape, box in shapes.items():
            boxes = [box(h, w) for h, w in sizes]
            for backend in backends:
                t0 = time.perf_counter()
                for data, bx in zip(blobs, boxes):
                    decode_rgb_region(data, *bx, backend=backend)
                best[shape, backend] = min(best[shape, backend], (time.perf_counter() - t0) / len(blobs) * 1e6)
    print(f"{len(blobs)} JPEGs, µs per image, one thread, best of {o.rounds} rounds")
    print(f"{'region':<22}" + "".join(f"{b:>16}" for b in backends))
    for shape in shapes:
        print(f"{shape:<22}" + "".join(f"{best[shape, b]:>16.0f}" for b in backends))


if __name__ == "__main__":
    main()
