"""Batch JPEG decode on the GPU (nvJPEG through ``torchvision.io.decode_jpeg``) + the eval geometry.

Used by ``DynamicBatcher`` for batches of at least ``gpu_decode_min_batch`` JPEGs: one
batched nvJPEG call amortises its launch cost, while a lone image decodes faster on a CPU
core. The geometry is the eval preset's (resize the shorter side, center crop), done on
the GPU with the same bilinear antialiased resize, so outputs match the CPU path up to
decoder rounding (nvJPEG's IDCT and upsampling differ from libjpeg-turbo's by ±1-2).

Must not: be imported without CUDA (callers check first).
"""

from __future__ import annotations

import torch

__all__ = ["gpu_eval_batch"]


def gpu_eval_batch(datas: list[bytes], preset, device: torch.device) -> list[torch.Tensor]:
    """Decode ``datas`` on ``device`` and apply ``preset``'s resize + center crop there.

    Raises:
        RuntimeError: nvJPEG refused one of the images (the caller falls back to the CPU).
    """
    from torchvision.io import ImageReadMode, decode_jpeg

    encoded = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
    images = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    out = []
    for img in images:
        target = preset._target(img.shape[1], img.shape[2])
        out.append(preset._finish(img, target))
    return out
