"""Two checkouts of fastload, the same worker-process loader loop, alternating rounds: new / old per round.

    git worktree add /tmp/old <commit>
    python tools/ab_checkouts.py STORE /tmp/old . [--rounds 4] [--seconds 10] [--read | --float]
        [--workers 2] [--channels-last]

For a change inside the loader that no option turns off (so ``bench loader`` cannot put both sides in
one run): each round runs the loop once with each checkout first on ``PYTHONPATH`` (the order alternates
round by round), each in a fresh process: ``fastload.DataLoader(LMDBImageDataset(STORE,
transform=train_transform(224)), batch_size=64, num_workers=2, collate_fn=collate_uint8,
persistent_workers=True)``, one warm epoch, then images/s over ``--seconds``. The training loop does
nothing with a batch, or with ``--read`` reads one byte of every page of it (what a copy to the GPU
does to the pages), or with ``--float`` normalises it to float32 (``fastload.normalize``, as a CPU
step's input). Prints each side's images/s per round and new / old per round with the median.

Must not: be imported by the package (a tool, run by hand).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

_LOOP = """
import sys, time, torch
torch.set_num_threads(1)
from fastload import DataLoader, LMDBImageDataset, collate_uint8, normalize, train_transform
store, workers, seconds, mode, channels_last = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], \
    sys.argv[5] == "1"
ds = LMDBImageDataset(store, transform=train_transform(224, channels_last=channels_last))
dl = DataLoader(ds, batch_size=64, num_workers=workers, persistent_workers=True, drop_last=True, shuffle=True,
                collate_fn=collate_uint8, generator=torch.Generator().manual_seed(0))
for _ in dl:
    pass
n, t0, s = 0, time.perf_counter(), 0
while time.perf_counter() - t0 < seconds:
    for images, _labels in dl:
        n += len(images)
        if mode == "read":
            s += int(images.reshape(-1)[::4096].sum())
        elif mode == "float":
            normalize(images)
print(n / (time.perf_counter() - t0))
"""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("store")
    p.add_argument("old", help="the old checkout (its root: the folder holding fastload/)")
    p.add_argument("new", help="the new checkout")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--channels-last", action="store_true")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--read", action="store_true", help="read one byte of every page of each batch")
    mode.add_argument("--float", action="store_true", help="normalise each batch to float32")
    o = p.parse_args(argv)
    loop = "read" if o.read else "float" if o.float else "none"
    sides = {"old": os.path.abspath(o.old), "new": os.path.abspath(o.new)}
    for name, root in sides.items():
        if not os.path.isfile(os.path.join(root, "fastload", "__init__.py")):
            raise SystemExit(f"{name}: {root} holds no fastload/ package")
    rates: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(o.rounds):
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            env = dict(os.environ, PYTHONPATH=sides[name])
            out = subprocess.run([sys.executable, "-c", _LOOP, o.store, str(o.workers), str(o.seconds), loop,
                                  "1" if o.channels_last else "0"], env=env, capture_output=True, text=True,
                                 cwd="/", check=False)
            if out.returncode != 0:
                raise SystemExit(f"{name} (round {r + 1}) failed:\n{out.stderr[-2000:]}")
            rates[name].append(float(out.stdout.split()[-1]))
            print(f"round {r + 1} {name}: {rates[name][-1]:.0f} images/s", flush=True)
    ratios = [n / o_ for n, o_ in zip(rates["new"], rates["old"])]
    print(f"loop: {loop}; old {statistics.median(rates['old']):.0f}, new {statistics.median(rates['new']):.0f} "
          f"images/s (medians); new / old per round: {statistics.median(ratios):.3f}x "
          f"({min(ratios):.3f}-{max(ratios):.3f}) over {o.rounds} rounds")


if __name__ == "__main__":
    main()
