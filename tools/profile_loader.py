"""Where a loader's CPU goes, per stage, in microseconds per image, from a real sampling profiler.

    python tools/profile_loader.py STORE [--backend threads|processes|both] [--batches 60]
        [--workers 2] [--float] [--channels-last] [--rate 250] [--out DIR]

Runs ``fastload.DataLoader(LMDBImageDataset(STORE, transform=train_transform(224)),
batch_size=64, collate_fn=collate_uint8)`` under ``py-spy record --native --subprocesses
--idle --format raw`` (py-spy is not a fastload dependency: ``pip install py-spy``), then
puts every sample of every thread and process into one stage by its stack (``_STAGES``,
first match from the leaf up): decode, crop/resize, flip, batch copy, normalise, hand-over
(queues, pickling, shared memory), store read, crop-box RNG, header parse, other Python per
sample. A sample is thread time (on a core, or runnable and waiting for one: on a loaded
machine that inflates every stage alike), so a stage's CPU is its share of the work samples
times the CPU time the OS counted for the loop (``os.times()``, the worker processes
included: they are reaped before it is read), per image handed out.
A thread blocked (its leaf frame a futex, condition or poll wait: an idle loader thread, the
training thread waiting for a batch) is "waiting (not CPU)"; a thread blocked taking the GIL
is "GIL wait": both are time, not CPU, and are left out of the CPU total.

``--float`` normalises each batch in the main process (``fastload.normalize``), as
``bench loader`` does; without it the batches stay ``uint8`` (a GPU host's case).
``--channels-last``: the preset with ``channels_last=True`` (channels-last batches).
With ``--drive`` the script is the profiled loader itself (what py-spy runs).

Must not: be imported by the package (a tool, run by hand).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time
from pathlib import Path

# (stage, substrings of a frame, any of which puts the sample in the stage); checked from the
# leaf frame upwards, the first frame that matches any stage wins, so a resize inside the
# preset counts as resize, not as the preset's Python.
_STAGES = [
    ("decode", ("decode_jpeg (", "tjDecompress", "jpeg_", "decode_rgb_region", "decode_rgb_fast", "nvimgcodec",
                "decode_mcu", "jsimd_", "ycc_rgb", "libjpeg", "decompress_", "decode_reference")),
    ("crop/resize", ("upsample", "interpolate", "_resize", "ImagingResample", "resize_and_crop")),
    ("crop-box RNG", ("crop_box", "_RRC", "uniform_", "random_", "randint", "rand (", "manual_seed", "Generator",
                      "mix_seed", "_draw_buffers", "TrainTransform._flip (", "TrainTransform.draw (")),
    ("flip", ("flip",)),
    ("normalise", ("normalize", "_normalize_cpu")),
    ("store read", ("StoreReader", "trans_get", "checksum", "crc32", "get_bytes")),
    ("batch copy", ("copy_", "stack", "collate", "copy_kernel", "memcpy", "memmove", "new_shared")),
    ("hand-over", ("rebuild_storage", "reduce_storage", "_recv", "recv_bytes", "ForkingPickler", "pin_memory",
                   "_try_get_data", "_get_data", "send_bytes", "Queue.put", "Queue.get", "_feed")),
    ("header parse", ("image_size", "decode_jpeg_header", "sniff")),
]
# CPython 3.12 waits for the GIL in take_gil's pthread_cond_timedwait (locks and queues wait on
# semaphores); py-spy's native unwinding often shows only the libc frame under the call that
# released the GIL (a torch op's gil_scoped_release, lmdb's get)
_GIL = ("take_gil", "PyEval_RestoreThread", "PyEval_AcquireThread", "PyGILState_Ensure", "gil_scoped_release")
_WAIT = ("sem_wait", "sem_timedwait", "sem_clockwait", "PyThread_acquire_lock", "epoll_wait", "select (",
         "poll (", "nanosleep", "sleep", "wait4", "accept", "do_futex", "futex")


# a sample counts only inside the timed loop: the driver's loop or a loader thread or worker process
_LOOP = ("_drive (", "_Pool._work", "_worker_loop", "Thread.run")
_NOT_CPU = ("waiting (not CPU)", "GIL wait", "startup, exit (not counted)")


def _drive(args) -> None:
    import torch

    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.loader import DataLoader
    from fastload.load.transforms import collate_uint8, normalize, train_transform

    torch.set_num_threads(1)
    ds = LMDBImageDataset(args.store, transform=train_transform(224, channels_last=args.channels_last))
    loader = DataLoader(ds, batch_size=64, shuffle=True, num_workers=args.workers, collate_fn=collate_uint8,
                        backend=args.backend, drop_last=True, persistent_workers=args.backend == "processes",
                        pin_memory=False, generator=torch.Generator().manual_seed(0))
    c0, n, t0 = os.times(), 0, time.perf_counter()
    while n < args.batches:
        for images, _labels in loader:
            if args.float:
                normalize(images, channels_last=args.channels_last)
            n += 1
            if n >= args.batches:
                break
    dt = time.perf_counter() - t0
    del loader  # persistent workers exit and are reaped: their CPU time shows in os.times' children
    import gc

    gc.collect()
    time.sleep(0.5)
    c1 = os.times()
    cpu = (c1.user + c1.system + c1.children_user + c1.children_system
           - c0.user - c0.system - c0.children_user - c0.children_system)
    print(f"DRIVE images={n * 64} seconds={dt:.3f} cpu={cpu:.3f}", flush=True)


def _stage_of(frames: list[str]) -> str:
    """The stage of one sampled stack (py-spy's raw format: root first, leaf last)."""
    if any("_find_and_load" in f for f in frames) or not any(k in f for f in frames for k in _LOOP):
        return "startup, exit (not counted)"
    while frames and frames[-1].startswith("0x"):  # unresolved libc frames under the call that waits
        frames = frames[:-1]
    leaf = frames[-1] if frames else ""
    if any(k in f for f in frames for k in _GIL) or ("pthread_cond" in leaf and "nvimgcodec" not in leaf
                                                      and not any("nvimgcodec" in f for f in frames[-3:])):
        return "GIL wait"
    if "pthread_cond" in leaf or any(k in leaf for k in _WAIT):
        return "waiting (not CPU)"
    for frame in reversed(frames):
        for stage, keys in _STAGES:
            if any(k in frame for k in keys):
                return stage
    return "other Python / per-sample"


def breakdown(raw: Path, images: int, rate: int) -> dict[str, float]:
    """Thread-time µs per image of each stage in py-spy's raw (collapsed) output, summed over threads
    and processes (on a core or runnable: sampling cannot tell them apart)."""
    counts: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        counts[_stage_of(frames[1:])] += int(n)  # the first frame names the process and thread
    return {stage: c / rate / images * 1e6 for stage, c in counts.most_common()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--backend", choices=("threads", "processes", "both"), default="both")
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--float", action="store_true")
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--rate", type=int, default=250)
    ap.add_argument("--out", default="profile-loader")
    ap.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive:
        return _drive(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for backend in (("threads", "processes") if args.backend == "both" else (args.backend,)):
        raw = out / f"{backend}{'-float' if args.float else ''}{'-cl' if args.channels_last else ''}.txt"
        cmd = ["py-spy", "record", "--native", "--subprocesses", "--idle", "--format", "raw", "--rate",
               str(args.rate), "-o", str(raw), "--", sys.executable, __file__, args.store, "--drive",
               "--backend", backend, "--batches", str(args.batches), "--workers", str(args.workers)]
        if args.float:
            cmd.append("--float")
        if args.channels_last:
            cmd.append("--channels-last")
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
        line = next((ln for ln in res.stdout.splitlines() if ln.startswith("DRIVE")), None)
        if res.returncode != 0 or line is None:
            sys.exit(f"py-spy failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
        fields = dict(kv.split("=") for kv in line.split()[1:])
        images, seconds = int(fields["images"]), float(fields["seconds"])
        stages = breakdown(raw, images, args.rate)
        work = sum(v for k, v in stages.items() if k not in _NOT_CPU)
        cpu_us = float(fields["cpu"]) / images * 1e6
        print(f"{backend}{' (float batches)' if args.float else ' (uint8 batches)'}: {images} images in "
              f"{seconds:.2f} s = {images / seconds:.0f} images/s; CPU {cpu_us:.0f} us/image (os.times, loader "
              f"threads or worker processes and the training process)")
        for stage, us in stages.items():
            if stage in _NOT_CPU:
                print(f"  {stage:<28}{us:>9.0f} us/image of thread time")
            else:  # the stage's share of the sampled work, times the CPU time the OS counted
                print(f"  {stage:<28}{us / work * cpu_us:>9.0f} us/image CPU ({us / work:.0%} of the work samples)")


if __name__ == "__main__":
    main()
