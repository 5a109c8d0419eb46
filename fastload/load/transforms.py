"""Train/eval presets that keep images ``uint8`` until they reach the device.

Owns: ``train_transform`` (random-resized-crop + horizontal flip) and ``eval_transform``
(resize shorter side + center crop), both producing ``uint8`` CHW tensors, the ``uint8``
collate, and ``normalize`` (uint8 → float, mean/std) that runs on the device.

Geometry is torchvision's: ``rrc_params`` draws from torch's global RNG with the same
calls, in the same order, as ``torchvision.transforms.RandomResizedCrop.get_params``
followed by ``RandomHorizontalFlip``, so under the same seed the crops are the same boxes
(a test pins this). Resizing is torchvision's own bilinear antialiased ``uint8`` kernel.

Given the encoded bytes (``from_bytes``, which ``LMDBImageDataset`` calls when a preset
is its transform), a JPEG is decoded at the smallest DCT scale (1/2, 1/4, 1/8) that still
leaves the crop at least as large as the output, so resizing never upsamples a region
torchvision would have downsampled. At scale 1 the crop box is exact; at smaller scales it
is rounded outwards to whole pixels of the scaled image (at most ``1/scale`` source pixels).

Why uint8 on the CPU: a float32 224×224 image is 602 KB through the DataLoader's shared
memory and pinned copy, a uint8 one 150 KB; ToTensor/Normalize on the CPU cost more than
the decode. On the GPU the conversion is free.

Must not: read stores or know about DataLoader workers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from fastload.load.decode import decode_rgb_fast, image_size

__all__ = [
    "IMAGENET_MEAN", "IMAGENET_STD", "TrainTransform", "EvalTransform", "train_transform",
    "eval_transform", "collate_uint8", "normalize", "rrc_params",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def rrc_params(height: int, width: int, scale: tuple[float, float] = (0.08, 1.0),
               ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """``(top, left, h, w)`` of a random-resized crop, exactly as torchvision draws it."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,)).item()
            j = torch.randint(0, width - w + 1, size=(1,)).item()
            return int(i), int(j), h, w
    in_ratio = float(width) / float(height)  # fallback: central crop
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _resize(chw: torch.Tensor, size: list[int]) -> torch.Tensor:
    from torchvision.transforms.v2 import functional as F

    if list(chw.shape[-2:]) == size:
        return chw
    return F.resize(chw, size, antialias=True)


def _as_chw(img) -> torch.Tensor:
    """PIL image, HWC ndarray or CHW uint8 tensor → CHW uint8 tensor (a view where possible)."""
    if isinstance(img, torch.Tensor):
        if img.dtype != torch.uint8 or img.dim() != 3:
            raise TypeError(f"expected a uint8 CHW tensor, got {img.dtype} of shape {tuple(img.shape)}")
        return img
    if not isinstance(img, np.ndarray):
        img = np.array(img.convert("RGB"))  # a writable copy: torch refuses read-only buffers
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    if not img.flags.writeable or not img.flags.c_contiguous:
        img = np.array(img, order="C")
    return torch.from_numpy(img).permute(2, 0, 1)


class TrainTransform:
    """Random-resized crop to ``size`` and random horizontal flip, as a uint8 CHW tensor.

    Args:
        size: output side in pixels.
        scale, ratio: as ``torchvision.transforms.RandomResizedCrop``.
        flip_p: probability of a horizontal flip.
    """

    def __init__(self, size: int = 224, *, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip_p: float = 0.5) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if not 0 < scale[0] <= scale[1]:
            raise ValueError(f"scale must be (min, max) with 0 < min <= max, got {scale}")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio must be (min, max) with 0 < min <= max, got {ratio}")
        self.size, self.scale, self.ratio, self.flip_p = size, tuple(scale), tuple(ratio), flip_p

    def _finish(self, chw: torch.Tensor, flip: bool) -> torch.Tensor:
        out = _resize(chw, [self.size, self.size])
        out = out.flip(-1) if flip else out
        return out.contiguous()

    def from_bytes(self, data: bytes) -> torch.Tensor:
        """Decode only as much as the crop needs, then crop, resize and flip."""
        h, w = image_size(data)
        i, j, ch, cw = rrc_params(h, w, self.scale, self.ratio)
        flip = bool(torch.rand(1) < self.flip_p)
        arr = decode_rgb_fast(data, min_height=math.ceil(h * self.size / ch),
                              min_width=math.ceil(w * self.size / cw))
        fy, fx = arr.shape[0] / h, arr.shape[1] / w
        if arr.shape[:2] != (h, w):  # scaled decode: round the box outwards
            y0, x0 = int(i * fy), int(j * fx)
            y1 = min(arr.shape[0], math.ceil((i + ch) * fy))
            x1 = min(arr.shape[1], math.ceil((j + cw) * fx))
        else:
            y0, x0, y1, x1 = i, j, i + ch, j + cw
        chw = torch.from_numpy(arr).permute(2, 0, 1)[:, y0:y1, x0:x1]
        return self._finish(chw, flip)

    def __call__(self, img) -> torch.Tensor:
        chw = _as_chw(img)
        i, j, ch, cw = rrc_params(chw.shape[1], chw.shape[2], self.scale, self.ratio)
        flip = bool(torch.rand(1) < self.flip_p)
        return self._finish(chw[:, i:i + ch, j:j + cw], flip)

    def __repr__(self) -> str:
        return f"TrainTransform(size={self.size}, scale={self.scale}, ratio={self.ratio}, flip_p={self.flip_p})"


class EvalTransform:
    """Resize the shorter side to ``resize``, center-crop ``size``, as a uint8 CHW tensor.

    Same output sizes and crop offsets as ``Compose([Resize(resize), CenterCrop(size)])``.
    """

    def __init__(self, size: int = 224, resize: int = 256) -> None:
        if size < 1 or resize < size:
            raise ValueError(f"need 1 <= size <= resize, got size={size}, resize={resize}")
        self.size, self.resize = size, resize

    def _target(self, h: int, w: int) -> list[int]:
        if h <= w:
            return [self.resize, int(self.resize * w / h)]
        return [int(self.resize * h / w), self.resize]

    def _finish(self, chw: torch.Tensor, target: list[int]) -> torch.Tensor:
        out = _resize(chw, target)
        top = int(round((target[0] - self.size) / 2.0))
        left = int(round((target[1] - self.size) / 2.0))
        return out[:, top:top + self.size, left:left + self.size].contiguous()

    def from_bytes(self, data: bytes) -> torch.Tensor:
        h, w = image_size(data)
        target = self._target(h, w)
        arr = decode_rgb_fast(data, min_height=target[0], min_width=target[1])
        return self._finish(torch.from_numpy(arr).permute(2, 0, 1), target)

    def __call__(self, img) -> torch.Tensor:
        chw = _as_chw(img)
        return self._finish(chw, self._target(chw.shape[1], chw.shape[2]))

    def __repr__(self) -> str:
        return f"EvalTransform(size={self.size}, resize={self.resize})"


def train_transform(size: int = 224, **kwargs) -> TrainTransform:
    """The training preset: ``TrainTransform(size, scale=..., ratio=..., flip_p=...)``."""
    return TrainTransform(size, **kwargs)


def eval_transform(size: int = 224, resize: int = 256) -> EvalTransform:
    """The evaluation preset: ``EvalTransform(size, resize)``."""
    return EvalTransform(size, resize)


def collate_uint8(batch: Sequence[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``(uint8 CHW, label)`` samples into ``(uint8 NCHW, int64 labels)``, no float on the CPU.

    In a DataLoader worker the batch is built straight in shared memory (as torch's
    ``default_collate`` does), so it reaches the main process without another copy.

    Raises:
        TypeError: a sample is not uint8 — a ``ToTensor()`` in the transform converts to
            float on the CPU, which is the cost this collate exists to avoid.
    """
    images = [b[0] for b in batch]
    first = images[0]
    if not isinstance(first, torch.Tensor) or first.dtype != torch.uint8:
        got = first.dtype if isinstance(first, torch.Tensor) else type(first).__name__
        raise TypeError(
            f"collate_uint8 expects uint8 CHW tensors, got {got}.\nHINT: use "
            "fastload.train_transform()/eval_transform() (they keep uint8) and normalise on the "
            "device with DevicePrefetcher, instead of ToTensor()/Normalize() in the dataset."
        )
    out = None
    if torch.utils.data.get_worker_info() is not None:
        storage = first._typed_storage()._new_shared(len(images) * first.numel(), device=first.device)
        out = first.new(storage).resize_(len(images), *first.shape)
    stacked = torch.stack(images, 0, out=out)
    labels = torch.as_tensor([int(b[1]) for b in batch], dtype=torch.int64)
    return stacked, labels


_STATS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _stats(mean: Sequence[float], std: Sequence[float], scale: float, device: torch.device):
    """mean*scale and std*scale as (1, C, 1, 1) tensors on ``device``, made once per device."""
    key = (tuple(mean), tuple(std), scale, device)
    hit = _STATS.get(key)
    if hit is None:  # built on the CPU and copied once: no host sync per batch afterwards
        m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1) * scale
        s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1) * scale
        hit = _STATS[key] = (m.to(device), s.to(device))
    return hit


def normalize(images: torch.Tensor, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
              *, dtype: torch.dtype = torch.float32, channels_last: bool = False) -> torch.Tensor:
    """``uint8`` NCHW (0..255) → ``dtype`` normalised by mean/std (given on the 0..1 scale).

    Float input is taken as already in 0..1. Runs wherever ``images`` is: call it on the device.
    """
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    scale = 255.0 if images.dtype == torch.uint8 else 1.0
    m, s = _stats(mean, std, scale, images.device)
    x = images.to(torch.float32).sub_(m).div_(s)
    return x if dtype == torch.float32 else x.to(dtype)
