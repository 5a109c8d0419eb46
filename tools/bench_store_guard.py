"""What the changed-store guard costs: ``StoreReader.get`` with and without its ``os.stat``.

Usage: ``python tools/bench_store_guard.py STORE`` (any store; ``fastload convert`` makes one).
Interleaved rounds (7 x 20,000 reads each way), medians; one ``eval_transform(224)`` sample for scale.
"""

import statistics, time, sys
from fastload.store.reader import StoreReader
from fastload.load.dataset import LMDBImageDataset
from fastload.load.transforms import eval_transform
store = sys.argv[1]
r = StoreReader(store)
n = len(r)
check = StoreReader._check_unchanged
def timed(reps=20000):
    t = time.perf_counter_ns()
    for k in range(reps):
        r.get(k % n)
    return (time.perf_counter_ns() - t) / reps
on, off = [], []
for rnd in range(7):  # interleaved rounds
    StoreReader._check_unchanged = check; on.append(timed())
    StoreReader._check_unchanged = lambda self, s, i: None; off.append(timed())
StoreReader._check_unchanged = check
ds = LMDBImageDataset(store, transform=eval_transform(224))
t = time.perf_counter_ns(); [ds[k % n] for k in range(200)]; dec = (time.perf_counter_ns() - t) / 200
print(f"get() with the check: median {statistics.median(on):.0f} ns, without: {statistics.median(off):.0f} ns, "
      f"check costs {statistics.median(on) - statistics.median(off):.0f} ns/read "
      f"(ratio {statistics.median(on) / statistics.median(off):.2f}); one eval_transform(224) sample: {dec / 1000:.0f} us")
