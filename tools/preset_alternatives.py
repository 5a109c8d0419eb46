"""The train preset's per-image work, and alternatives for the work after the decode, side by side.

    python tools/preset_alternatives.py STORE [--rounds 5] [--seconds 1] [--size 224]

One process, one thread (torch too), the same records and the same crop draws for every arm,
in interleaved rounds (``fastload.measure.rounds.interleave``, order rotated each round).
Arms, in µs per image (median of rounds and min-max) and as a ratio to ``decode`` per round:

* ``decode``: ``TrainTransform.decode_crop`` alone (DCT scale or region, as the preset);
* ``preset``: ``train_transform(size).from_bytes`` as it is now;
* ``preset-channels-last``: the same with ``channels_last=True`` (same bytes, written
  channels-last: no planar scatter in the resize kernel);
* ``preset-before``: the same preset as it was before #30 (an ``item()`` per draw and fresh
  tensors, the flip drawn with ``rand(1) < p``, torch's ``permute`` and slicing,
  ``F.interpolate`` with its argument checks);
* on the decoded crops only (decode excluded): ``resize-torch`` (the kernel the preset uses,
  exact to torchvision), ``resize-torch-cl`` (the same kernel writing channels-last), ``resize-pil`` (Pillow ``reduce`` + BILINEAR, not exact),
  ``resize-cv2`` (OpenCV ``INTER_AREA``, not exact; skipped when cv2 is not importable),
  ``resize+flip+copy`` (torch's kernel, then the flip fused into the copy into a batch
  slot with numpy's negative stride) against ``resize,flip,copy`` (as the thread pipeline does).

Must not: be imported by the package (a tool, run by hand). Figures are noisy on a shared
machine: use the per-round ratios, not the absolute µs.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--size", type=int, default=224)
    args = ap.parse_args()

    import torch
    from PIL import Image

    from fastload.image.fast import decode_rgb_fast, decode_rgb_region, image_size
    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.transforms import train_transform
    from fastload.measure.rounds import interleave

    torch.set_num_threads(1)
    size = args.size
    tf = train_transform(size)
    tf_cl = train_transform(size, channels_last=True)
    ds = LMDBImageDataset(args.store)
    blobs = [ds.get_bytes(i) for i in range(min(len(ds), 256))]
    drawn = [tf.draw(b, torch.Generator().manual_seed(k)) for k, b in enumerate(blobs)]
    crops = [tf.decode_crop(b, d) for b, d in zip(blobs, drawn)]
    crops_np = [c.permute(1, 2, 0).numpy() for c in crops]  # HWC views of the same crops
    slot = torch.empty((3, size, size), dtype=torch.uint8)
    slot_np = slot.numpy()
    gens = [torch.Generator() for _ in blobs]

    def before(data: bytes, g: torch.Generator) -> torch.Tensor:  # from_bytes as it was before #30
        h, w = image_size(data)
        i, j, ch, cw = tf._rrc._draw_items(h, w, g)  # torchvision's calls as written: an item() per draw
        flip = bool(torch.rand(1, generator=g) < tf.flip_p)
        min_h, min_w = math.ceil(h * size / ch), math.ceil(w * size / cw)
        if 2 * min_h > h or 2 * min_w > w:
            chw = torch.from_numpy(decode_rgb_region(data, i, j, ch, cw)).permute(2, 0, 1)
        else:
            arr = decode_rgb_fast(data, min_height=min_h, min_width=min_w, size=(h, w))
            fy, fx = arr.shape[0] / h, arr.shape[1] / w
            if arr.shape[:2] != (h, w):
                y0, x0 = int(i * fy), int(j * fx)
                y1, x1 = min(arr.shape[0], math.ceil((i + ch) * fy)), min(arr.shape[1], math.ceil((j + cw) * fx))
            else:
                y0, x0, y1, x1 = i, j, i + ch, j + cw
            chw = torch.from_numpy(arr).permute(2, 0, 1)[:, y0:y1, x0:x1]
        out = torch.nn.functional.interpolate(chw.unsqueeze(0), size=[size, size], mode="bilinear",
                                              align_corners=False, antialias=True)[0]
        return out.flip(-1) if flip else out

    def resize_torch(k: int) -> torch.Tensor:
        return torch._C._nn._upsample_bilinear2d_aa(crops[k].unsqueeze(0), [size, size], False, None)[0]

    def resize_torch_cl(k: int) -> torch.Tensor:
        out = torch.empty((1, 3, size, size), dtype=torch.uint8, memory_format=torch.channels_last)
        return torch._C._nn._upsample_bilinear2d_aa(crops[k].unsqueeze(0), [size, size], False, None, out=out)[0]

    def separate(k: int) -> None:
        out = resize_torch(k)
        slot.copy_(out.flip(-1) if drawn[k][6] else out)

    def fused(k: int) -> None:
        out = resize_torch(k).numpy()  # CHW view (channels-last strides)
        np.copyto(slot_np, out[:, :, ::-1] if drawn[k][6] else out)

    def resize_pil(k: int) -> None:
        im = Image.fromarray(crops_np[k])
        f = min(im.width // size, im.height // size)
        if f >= 2:
            im = im.reduce(f)
        np.asarray(im.resize((size, size), Image.BILINEAR))

    arms = {
        "decode": lambda k: tf.decode_crop(blobs[k], drawn[k]),
        "preset": lambda k: tf.from_bytes(blobs[k], gens[k].manual_seed(k)),
        "preset-channels-last": lambda k: tf_cl.from_bytes(blobs[k], gens[k].manual_seed(k)),
        "preset-before": lambda k: before(blobs[k], gens[k].manual_seed(k)),
        "resize-torch": resize_torch,
        "resize-torch-cl": resize_torch_cl,
        "resize-pil": resize_pil,
        "resize,flip,copy": separate,
        "resize+flip+copy": fused,
    }
    try:
        import cv2

        cv2.setNumThreads(1)
        arms["resize-cv2"] = lambda k: cv2.resize(crops_np[k], (size, size), interpolation=cv2.INTER_AREA)
    except ImportError:
        print("resize-cv2: skipped (cv2 is not importable)")
    for k in range(len(blobs)):  # the same crops with both copies of the flip and copy
        separate(k)
        a = slot.clone()
        fused(k)
        assert torch.equal(a, slot), "the fused flip+copy must give the same bytes"
        assert torch.equal(tf.from_bytes(blobs[k], gens[k].manual_seed(k)), before(blobs[k], gens[k].manual_seed(k)))
        assert torch.equal(tf.from_bytes(blobs[k], gens[k].manual_seed(k)), tf_cl.from_bytes(blobs[k], gens[k].manual_seed(k)))
        assert torch.equal(resize_torch(k), resize_torch_cl(k))

    def measure(name: str, _round: int) -> float:
        fn, n, t0 = arms[name], 0, time.perf_counter()
        while n == 0 or time.perf_counter() - t0 < args.seconds:
            for k in range(len(blobs)):
                fn(k)
            n += len(blobs)
        return (time.perf_counter() - t0) / n * 1e6

    res = interleave(list(arms), args.rounds, measure)
    dec = res["decode"]
    print(f"{len(blobs)} records of {args.store}, {size}px, one thread, {args.rounds} interleaved rounds "
          f"x {args.seconds:g} s per arm")
    print(f"{'arm':<20}{'us/image':>10}{'min-max':>16}{'/ decode per round':>24}")
    for name, arm in res.items():
        ratios = sorted(v / d for v, d in zip(arm.values, dec.values))
        lo, hi = arm.spread()
        print(f"{name:<20}{arm.median():>10.0f}{f'{lo:.0f}-{hi:.0f}':>16}"
              f"{f'{ratios[len(ratios) // 2]:.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})':>24}")
    pre, old = res["preset"], res["preset-before"]
    r = sorted(p / o for p, o in zip(pre.values, old.values))
    print(f"preset / preset-before per round: {r[len(r) // 2]:.3f} ({r[0]:.3f}-{r[-1]:.3f})")
    r = sorted(c / p for c, p in zip(res["preset-channels-last"].values, pre.values))
    print(f"preset-channels-last / preset per round: {r[len(r) // 2]:.3f} ({r[0]:.3f}-{r[-1]:.3f})")


if __name__ == "__main__":
    main()
