"""The CPU normalisation as shipped (numpy) against the same arithmetic in torch ops, in a loader.

    python tools/normalise_alternatives.py STORE [--rounds 8] [--images 1280] [--channels-last]
                                           [--backend threads|processes]

``fastload.normalize`` on the CPU (``transforms._normalize_cpu``) casts and multiplies in one
numpy ufunc call and adds in a second. The alternative kept here for measurement: torch's
``copy_`` (the cast), ``mul_`` and ``add_`` on the same buffer (channels-last: rows of ``w*c``
values times a repeated per-channel vector), the same float32 values bit for bit (checked first).
First both are timed on their own (one batch of 64 into a reused buffer, one torch thread, 15
alternating repetitions); then where normalisation runs: in the training thread, after
``fastload.DataLoader(..., collate_fn=collate_uint8)``, inside ``DevicePrefetcher(loader, "cpu",
ahead=False)`` (which normalises into reused buffers, in the calling thread, as it did when this was
measured: the default now normalises on a helper thread), with torch's intra-op threads as the loader
leaves them.

Arms alternate each round (order reversed every other round); each arm builds its loader afresh
and takes 3 batches untimed. Prints images/s and the process tree's CPU time per image (psutil),
and the per-round ratios torch/numpy. Asserts nothing about timings.

Must not: be imported by the package (a tool, run by hand).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--images", type=int, default=1280)
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--backend", choices=("threads", "processes"), default="threads")
    args = ap.parse_args()

    import numpy as np
    import psutil
    import torch

    import fastload.load.transforms as T
    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.loader import DataLoader
    from fastload.load.prefetch import DevicePrefetcher
    from fastload.load.transforms import collate_uint8, train_transform

    def torch_ops(images, mean, std, channels_last, into=None):
        n, c, h, w = images.shape
        inv = 1.0 / (255.0 * np.asarray(std, dtype=np.float64))
        scale, bias = inv.astype(np.float32), (-np.asarray(mean, dtype=np.float64) * 255.0 * inv).astype(np.float32)
        if into is None:
            into = torch.from_numpy(np.empty((n, h, w, c), dtype=np.float32)).permute(0, 3, 1, 2) if channels_last \
                else torch.from_numpy(np.empty((n, c, h, w), dtype=np.float32))
        into.copy_(images)
        if channels_last:
            rows = into.permute(0, 2, 3, 1).view(n * h, w * c)
            rows.mul_(torch.from_numpy(np.tile(scale, w))).add_(torch.from_numpy(np.tile(bias, w)))
        else:
            into.mul_(torch.from_numpy(scale).view(1, c, 1, 1)).add_(torch.from_numpy(bias).view(1, c, 1, 1))
        return into

    cl = args.channels_last
    arms = {"numpy (shipped)": T._normalize_cpu, "torch ops": torch_ops}
    x = torch.randint(0, 256, (4, 3, 224, 224), dtype=torch.uint8)
    x = x.contiguous(memory_format=torch.channels_last) if cl else x
    ref = None
    for fn in arms.values():  # the same values
        T._normalize_cpu = fn
        got = T.normalize(x, channels_last=cl)
        ref = got if ref is None else ref
        assert torch.equal(got, ref), "the two arms must give the same values"

    from fastload.measure.timing import one_torch_thread

    batch = torch.randint(0, 256, (64, 3, 224, 224), dtype=torch.uint8)
    batch = batch.contiguous(memory_format=torch.channels_last) if cl else batch
    out = torch.empty(batch.shape, dtype=torch.float32, memory_format=torch.channels_last if cl else
                      torch.contiguous_format)
    alone: dict[str, list[float]] = {a: [] for a in arms}
    with one_torch_thread():
        for k in range(15):
            for arm in (list(arms) if k % 2 == 0 else list(arms)[::-1]):
                t0 = time.perf_counter()
                T._normalize_cpu = arms[arm]
                T.normalize(batch, channels_last=cl, out=out)
                alone[arm].append((time.perf_counter() - t0) / 64 * 1e6)
    a0, a1 = (alone[a] for a in arms)
    q = sorted(b / a for a, b in zip(a0, a1))
    print("alone, one thread, a batch of 64 into a reused buffer: " + ", ".join(
        f"{a} {statistics.median(v):.0f} us/image ({min(v):.0f}-{max(v):.0f})" for a, v in alone.items())
        + f"; torch ops / numpy {statistics.median(q):.2f} ({q[0]:.2f}-{q[-1]:.2f})")

    me = psutil.Process()

    def tree_cpu() -> float:
        total = 0.0
        for p in [me, *me.children(recursive=True)]:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
        return total

    rate: dict[str, list[float]] = {a: [] for a in arms}
    cpu: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(args.rounds):
        for arm in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            T._normalize_cpu = arms[arm]
            ds = LMDBImageDataset(args.store, transform=train_transform(224, channels_last=cl))
            loader = DataLoader(ds, batch_size=64, shuffle=True, num_workers=2, backend=args.backend,
                                collate_fn=collate_uint8, generator=torch.Generator().manual_seed(r))
            it = iter(DevicePrefetcher(loader, "cpu", channels_last=cl, ahead=False))
            for _ in range(3):
                next(it)
            n, t0, c0 = 0, time.perf_counter(), tree_cpu()
            while n < args.images:
                try:
                    images, _ = next(it)
                except StopIteration:  # the epoch ended: the next one
                    it = iter(DevicePrefetcher(loader, "cpu", channels_last=cl, ahead=False))
                    continue
                n += len(images)
            dt, c1 = time.perf_counter() - t0, tree_cpu()
            del it, images
            rate[arm].append(n / dt)
            cpu[arm].append((c1 - c0) / n * 1e6)
    names = list(arms)
    print(f"{args.store}: {args.backend}, batch 64, 2 workers, {'channels-last' if cl else 'planar'} float32 "
          f"batches, {args.rounds} alternating rounds of {args.images} images")
    for a in names:
        print(f"{a:<18} {statistics.median(rate[a]):>6.0f} images/s ({min(rate[a]):.0f}-{max(rate[a]):.0f}), "
              f"CPU {statistics.median(cpu[a]):.0f} us/image ({min(cpu[a]):.0f}-{max(cpu[a]):.0f})")
    r = sorted(b / a for a, b in zip(rate[names[0]], rate[names[1]]))
    u = sorted(b / a for a, b in zip(cpu[names[0]], cpu[names[1]]) if a > 0)
    print(f"torch ops / numpy per round: images/s {statistics.median(r):.3f} ({r[0]:.3f}-{r[-1]:.3f}), "
          f"CPU per image {statistics.median(u):.3f} ({u[0]:.3f}-{u[-1]:.3f}); torch's intra-op threads in the "
          f"training thread: {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
