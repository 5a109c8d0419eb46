"""Where a loader spends the CPU its ceiling does not: the whole machine under `perf`, per image.

    python tools/perf_gap.py STORE [--seconds 10] [--rounds 2] [--workers 2] [--channels-last]
        [--side ceiling --side processes --side threads]

`bench loader` reports each path as a share of its ceiling (the preset's own loop in as many
processes at once as the loader has workers). This says where the rest goes. Each side runs
alone, warmed up, and for ``--seconds`` of steady state ``perf record -a`` samples every CPU
(idle included, as the kernel's halt); the side counts the images it made in that window. Each
sample is put in one group by its library and symbol (``GROUPS``: decode, resize, memcpy,
torch's copy and flip, the rest of torch, the Python interpreter, the kernel, crc32, libc,
idle), and a group's CPU per image is its share of the samples x the CPUs x the window / the
images. The sides alternate in rounds; each cell is the median of the rounds.

Sides: ``ceiling``, the preset's loop (``train_transform(224).from_bytes`` over ``floor_records``,
each process with its own seeded generator) in ``--workers`` processes at once;
``processes``, ``fastload.DataLoader`` with worker processes (batch 64, ``collate_uint8``, persistent
workers, ``uint8`` batches not normalised: a GPU host's case); ``threads``, the same with
``backend="threads"``. Everything on the machine is sampled, the training process and the
worker processes together, so the machine must be otherwise quiet.

``perf`` is not a fastload dependency (Debian: ``apt-get install linux-perf``); it needs
``perf_event_paranoid`` <= 0 or root for ``-a``. perf cannot name Python frames: use
``tools/profile_loader.py`` (py-spy) for the Python side of a group.

Must not: be imported by the package (a tool, run by hand).
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# (group, test on (library, symbol)); the first that matches wins
GROUPS = [
    ("idle", lambda dso, sym: "safe_halt" in sym or sym.startswith("intel_idle") or "cpuidle" in sym),
    ("decode (libjpeg-turbo, nvImageCodec, simplejpeg)", lambda dso, sym: "jpeg" in dso or "nvimgcodec" in dso),
    ("memcpy (libc)", lambda dso, sym: dso.startswith("libc.so") and ("memmove" in sym or "memcpy" in sym)),
    ("resize (torch's uint8 AA kernel)", lambda dso, sym: dso.startswith("libtorch_cpu") and any(
        s in sym for s in ("Resample", "pack_rgb", "unpack_rgb", "Interp", "_upsample"))),
    ("flip (torch)", lambda dso, sym: dso.startswith("libtorch_cpu") and "flip" in sym),
    ("copy (torch)", lambda dso, sym: dso.startswith("libtorch_cpu") and "copy" in sym),
    ("torch, other (dispatch, allocation)", lambda dso, sym: dso.startswith(("libtorch", "libc10"))),
    ("Python interpreter", lambda dso, sym: "python" in dso),
    ("kernel (syscalls, faults, scheduling)", lambda dso, sym: dso == "[kernel.kallsyms]"),
    ("crc32 (store checksums)", lambda dso, sym: dso.startswith("libz")),
    ("libc, other (malloc, locks)", lambda dso, sym: dso.startswith(("libc.so", "ld-linux"))),
    ("other", lambda dso, sym: True),
]
_LINE = re.compile(r"\s*([\d.]+)%\s+(\S+)\s+\[.\]\s+(.*)")
SIDES = ("ceiling", "processes", "threads")


def _loop(store: str, size: int, channels_last: bool, seed: int, start, seconds: float, out) -> None:
    import torch

    from fastload.bench.loader import floor_records
    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.transforms import train_transform

    torch.set_num_threads(1)
    tf = train_transform(size, channels_last=channels_last)
    blobs = floor_records(LMDBImageDataset(store))
    g = torch.Generator().manual_seed(seed)
    for b in blobs[:32]:
        tf.from_bytes(b, g)
    start.wait()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        tf.from_bytes(blobs[n % len(blobs)], g)
        n += 1
    out.put(n)


def _ceiling(o) -> None:
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_loop, args=(o.store, o.size, o.channels_last, 1000 + k, start, o.seconds + 1, out))
             for k in range(o.workers)]
    for p in procs:
        p.start()
    time.sleep(3)  # every process past its warm-up
    start.set()
    print("READY", flush=True)
    t0 = time.perf_counter()
    time.sleep(o.seconds)
    # the processes run one second past the window; count their images in it pro rata
    counts = [out.get() for _ in procs]
    span = time.perf_counter() - t0
    for p in procs:
        p.join()
    print("IMAGES", sum(counts) * o.seconds / max(span, o.seconds + 1), flush=True)


def _loader(o, backend: str) -> None:
    import torch

    from fastload import DataLoader, LMDBImageDataset, collate_uint8, train_transform

    torch.set_num_threads(1)
    ds = LMDBImageDataset(o.store, transform=train_transform(o.size, channels_last=o.channels_last))
    dl = DataLoader(ds, batch_size=64, num_workers=o.workers, persistent_workers=True, drop_last=True, shuffle=True,
                    collate_fn=collate_uint8, backend=backend, generator=torch.Generator().manual_seed(0))
    for _ in dl:  # one warm epoch: workers started, segments made
        pass
    print("READY", flush=True)
    n, t0 = 0, time.perf_counter()
    while True:
        for images, _labels in dl:
            n += len(images)
            if time.perf_counter() - t0 >= o.seconds:
                print("IMAGES", n * o.seconds / (time.perf_counter() - t0), flush=True)
                return


def _group(report: str) -> dict[str, float]:
    shares: dict[str, float] = collections.Counter()
    for line in report.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        pct, dso, sym = float(m[1]), m[2], m[3]
        name = next(g for g, test in GROUPS if test(dso, sym))
        shares[name] += pct / 100
    return shares


def _measure(o, side: str, tmp: str) -> tuple[float, dict[str, float]]:
    cmd = [sys.executable, __file__, o.store, "--run", side, "--seconds", str(o.seconds), "--workers", str(o.workers),
           "--size", str(o.size)] + (["--channels-last"] if o.channels_last else [])
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline()
    if line.strip() != "READY":
        child.wait()
        raise SystemExit(f"{side}: did not start ({line.strip() or 'no output'})")
    data = os.path.join(tmp, f"{side}.data")
    subprocess.run(["perf", "record", "-a", "-F", "999", "-q", "-o", data, "--", "sleep", str(o.seconds)],
                   check=True, stdout=subprocess.DEVNULL)
    rest = child.stdout.read()
    if child.wait() != 0:
        raise SystemExit(f"{side}: exited with {child.returncode}")
    images = float(next(ln.split()[1] for ln in rest.splitlines() if ln.startswith("IMAGES")))
    report = subprocess.run(["perf", "report", "-i", data, "--sort", "dso,sym", "--stdio", "-q"],
                            capture_output=True, text=True, check=True).stdout
    cpus = os.cpu_count() or 1
    return images / o.seconds, {g: s * cpus * o.seconds / images * 1e6 for g, s in _group(report).items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("store")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--side", action="append", choices=SIDES, help="sides to run (default: all three)")
    p.add_argument("--run", choices=SIDES, help=argparse.SUPPRESS)  # one side, as the parent's child
    o = p.parse_args(argv)
    if o.run == "ceiling":
        return _ceiling(o)
    if o.run:
        return _loader(o, o.run)
    if shutil.which("perf") is None:
        raise SystemExit("perf is not installed (Debian: apt-get install linux-perf)")
    sides = o.side or list(SIDES)
    rates: dict[str, list[float]] = {s: [] for s in sides}
    cells: dict[str, dict[str, list[float]]] = {s: collections.defaultdict(list) for s in sides}
    with tempfile.TemporaryDirectory(prefix="fastload-perf-gap-") as tmp:
        for r in range(o.rounds):
            for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                rate, per_image = _measure(o, side, tmp)
                rates[side].append(rate)
                for g, _ in GROUPS:
                    cells[side][g].append(per_image.get(g, 0.0))
                print(f"round {r + 1} {side}: {rate:.0f} images/s", file=sys.stderr, flush=True)
    med = {s: {g: statistics.median(v) for g, v in cells[s].items()} for s in sides}
    print(f"µs of CPU per image, {os.cpu_count()} CPUs sampled for {o.seconds:g} s, median of {o.rounds} rounds"
          f" ({o.workers} workers, batch 64, {'channels-last ' if o.channels_last else ''}uint8 batches)")
    print(f"{'group':50s}" + "".join(f"{s:>11s}" for s in sides))
    for g, _ in GROUPS:
        if any(med[s][g] >= 0.05 for s in sides):
            print(f"{g:50s}" + "".join(f"{med[s][g]:11.1f}" for s in sides))
    busy = {s: sum(v for g, v in med[s].items() if g != "idle") for s in sides}
    print(f"{'busy (all but idle)':50s}" + "".join(f"{busy[s]:11.1f}" for s in sides))
    print(f"{'images/s (median)':50s}" + "".join(f"{statistics.median(rates[s]):11.0f}" for s in sides))
    if "ceiling" in sides:
        for s in sides:
            if s != "ceiling":
                share = [a / c for a, c in zip(rates[s], rates["ceiling"])]
                print(f"{s}: {statistics.median(share):.0%} of the ceiling per round"
                      f" ({min(share):.0%}-{max(share):.0%})")


if __name__ == "__main__":
    main()
