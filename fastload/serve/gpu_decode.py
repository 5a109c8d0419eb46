"""Batch JPEG decode on the GPU (nvJPEG through ``torchvision.io.decode_jpeg``) + the eval geometry.

Used by ``DynamicBatcher`` for batches of at least ``gpu_decode_min_batch`` JPEGs: one
batched nvJPEG call amortises its launch cost, while a lone image decodes faster on a CPU
core. The geometry is the eval preset's (resize the shorter side, center crop), done on
the GPU. The resize runs in float: PyTorch implements the antialiased bilinear
``interpolate`` for ``uint8`` on the CPU only, so a CUDA ``uint8`` tensor must be converted
first, then rounded and clamped back — what torchvision's v2 ``Resize`` does for CUDA
``uint8``. Outputs match the CPU path up to decoder rounding (nvJPEG's IDCT and upsampling
differ from libjpeg-turbo's by ±1-2, and the CPU path may decode at a DCT-reduced scale).

Must not: be imported without CUDA (callers check first); swallow errors (the caller
counts the fallback and logs it).
"""

from __future__ import annotations

import torch

__all__ = ["gpu_eval_batch", "resize_uint8"]


def resize_uint8(chw: torch.Tensor, size: list[int]) -> torch.Tensor:
    """Antialiased bilinear resize of a ``uint8`` CHW tensor on any device (in float, rounded back)."""
    if list(chw.shape[-2:]) == list(size):
        return chw
    out = torch.nn.functional.interpolate(chw.unsqueeze(0).float(), size=size, mode="bilinear",
                                          align_corners=False, antialias=True)[0]
    return out.round_().clamp_(0, 255).to(torch.uint8)


def gpu_eval_batch(datas: list[bytes], preset, device: torch.device) -> list[torch.Tensor]:
    """Decode ``datas`` on ``device`` and apply ``preset``'s resize + center crop there.

    Returns ``uint8`` CHW tensors on ``device``.

    Raises:
        RuntimeError: nvJPEG refused one of the images (the caller falls back to the CPU).
    """
    from torchvision.io import ImageReadMode, decode_jpeg

    encoded = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
    images = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    out = []
    for img in images:
        target = preset.resize_target(img.shape[1], img.shape[2])
        # its resize then only lays the image out: a no-op for the planar preset (resize_uint8 gives CHW)
        out.append(preset.resize_and_crop(resize_uint8(img, target), target))
    return out
