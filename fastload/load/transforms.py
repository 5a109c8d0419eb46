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

``channels_last=True`` (either preset): the same values, the output CHW tensor laid out
channels-last in memory (a permuted HWC array, ``is_contiguous(memory_format=
torch.channels_last)`` of its batch). The resize kernel works on interleaved RGB: writing
its result planar (CHW) costs a scatter that writing it channels-last does not (120 against
187 µs for a 300x260 crop to 224, one thread). ``collate_uint8`` and the thread pipeline keep
the layout, so a model trained channels-last gets its batches without a transpose on either
side.

Must not: read stores or know about DataLoader workers.
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from fastload.image import DEFAULT_RESIZE, DEFAULT_SIZE
from fastload.image.fast import decode_jpeg_scaled_region, decode_rgb_fast, decode_rgb_region, image_size, jpeg_scale
from fastload.image.policy import mode_to_rgb
from fastload.marks import timed

__all__ = [
    "IMAGENET_MEAN", "IMAGENET_STD", "Preset", "is_preset", "preset_size", "TrainTransform", "EvalTransform",
    "train_transform", "eval_transform", "collate_uint8", "uint8_batch_layout", "normalize", "rrc_params",
    "preset_channels_last",
    "preset_writes_into", "preset_plans", "accepts_keyword",
]

@runtime_checkable
class Preset(Protocol):
    """The preset contract, written once: a transform fastload hands the stored bytes.

    ``from_bytes(data, generator=None)`` takes one image's encoded bytes and returns a
    ``uint8`` CHW tensor, drawing any randomness from ``generator`` when one is given (the
    thread pipeline and resume give each sample its own). ``TrainTransform`` and
    ``EvalTransform`` are fastload's; any transform with a callable ``from_bytes`` is treated
    alike: ``LMDBImageDataset`` and the serving batcher hand it bytes instead of a PIL image,
    and a resumed loader seeds it per sample. Optionally an integer ``size`` (the output is
    ``size`` x ``size``): then the thread pipeline writes into preallocated batch buffers and
    the ``/dev/shm`` preflight knows a batch's bytes (``preset_size``). Optionally
    ``channels_last = True``: the output is laid out channels-last, and so are the thread
    pipeline's batch buffers under ``collate_uint8``. Optionally a keyword ``out`` to
    ``from_bytes`` (``preset_writes_into``): a tensor of the output's shape the preset may
    write the image into and return (the thread pipeline passes its batch slot and copies
    only what comes back elsewhere). Optionally ``from_bytes`` split in two (``preset_plans``):
    ``plan(data, generator)``, every random draw and header read, and ``render(data, plan, *,
    out=None)``, the decode and the pixel work, with ``render(data, plan(data, g), out=o)``
    equal to ``from_bytes(data, g, out=o)``: the thread pipeline plans a few samples in a row
    (many small GIL-holding steps) before it renders them (long steps without the GIL).

    Test for it with ``is_preset(transform)``, nowhere else.
    """

    def from_bytes(self, data: bytes, generator: torch.Generator | None = None) -> torch.Tensor: ...


def is_preset(transform: object) -> bool:
    """Whether ``transform`` follows the preset contract (``Preset``): it takes the stored bytes."""
    return callable(getattr(transform, "from_bytes", None))


def preset_size(transform: object) -> int | None:
    """The output side of a preset that says it (an integer ``size``), else None."""
    size = getattr(transform, "size", None)
    return size if is_preset(transform) and isinstance(size, int) else None


def accepts_keyword(fn: object, name: str) -> bool:
    """Whether callable ``fn`` has a parameter ``name`` (False when its signature cannot be read)."""
    try:
        return callable(fn) and name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def preset_writes_into(transform: object) -> bool:
    """Whether a preset's ``from_bytes`` takes ``out=`` (may write its image into a given tensor)."""
    return accepts_keyword(getattr(transform, "from_bytes", None), "out")


def preset_plans(transform: object) -> bool:
    """Whether a preset splits ``from_bytes`` into ``plan`` and ``render`` (the ``Preset`` contract).

    Only where ``plan`` and ``render`` are defined by the class that defines ``from_bytes``, or by a
    subclass of it: a subclass that overrides ``from_bytes`` alone (say, to change the pixels) must
    have its ``from_bytes`` run, not its parent's split of it.
    """
    if not (is_preset(transform) and callable(getattr(transform, "plan", None))
            and callable(getattr(transform, "render", None))):
        return False
    mro = type(transform).__mro__

    def depth(name: str) -> int | None:  # where in the MRO the attribute is defined (None: on the instance)
        if name in getattr(transform, "__dict__", {}):
            return None
        return next((k for k, cls in enumerate(mro) if name in cls.__dict__), None)

    fb, plan, render = depth("from_bytes"), depth("plan"), depth("render")
    return None not in (fb, plan, render) and plan <= fb and render <= fb


def preset_channels_last(transform: object) -> bool:
    """Whether a preset says its output is laid out channels-last (``channels_last is True``)."""
    return is_preset(transform) and getattr(transform, "channels_last", False) is True


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def rrc_params(height: int, width: int, scale: tuple[float, float] = (0.08, 1.0),
               ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """``(top, left, h, w)`` of a random-resized crop, exactly as torchvision draws it."""
    return _RRC(scale, ratio)(height, width)


_LOCAL = threading.local()


def _draw_buffers():
    """This thread's 1-element draw tensors and numpy views of them: ``(float, its view, int64, its view)``.

    The float one has torch's default dtype, as ``torch.empty(1)`` in torchvision's draws; a
    default dtype numpy cannot view gives ``(None, None, None, None)``.
    """
    dtype = torch.get_default_dtype()
    bufs = getattr(_LOCAL, "bufs", None)
    if bufs is None or bufs[0] != dtype:
        if dtype in (torch.float32, torch.float64):
            f, i = torch.empty(1, dtype=dtype), torch.empty(1, dtype=torch.int64)
            bufs = (dtype, f, f.numpy(), i, i.numpy())
        else:
            bufs = (dtype, None, None, None, None)
        _LOCAL.bufs = bufs
    return bufs[1:]


class _RRC:
    """torchvision's ``RandomResizedCrop.get_params`` with its constants computed once.

    The same torch RNG calls in the same order (one ``uniform_`` on a 1-element float
    tensor per draw, ``random_(low, high)`` on a 1-element int64 tensor for the offsets, which
    is what ``randint`` runs), so the same boxes under the same seed. Only the calls that draw
    are torch ops: the values are read back through a numpy view of the same 1-element
    tensors, reused per thread, instead of ``item()`` and fresh tensors. Each torch op called
    from Python releases and retakes the GIL, a hand-off to another loader thread under the
    thread pipeline (docs/loader.md, "Where the CPU goes"): 5 ops per box instead of 11.
    """

    def __init__(self, scale: tuple[float, float], ratio: tuple[float, float]) -> None:
        log_ratio = torch.log(torch.tensor(ratio))
        self.scale = (float(scale[0]), float(scale[1]))
        self.log_ratio = (log_ratio[0].item(), log_ratio[1].item())
        self.ratio = ratio

    def __call__(self, height: int, width: int, generator: torch.Generator | None = None) -> tuple[int, int, int, int]:
        area = height * width
        fbuf, fval, ibuf, ival = _draw_buffers()
        if fbuf is None:  # a default dtype numpy cannot view (e.g. bfloat16): torchvision's calls as written
            return self._draw_items(height, width, generator)
        for _ in range(10):
            fbuf.uniform_(*self.scale, generator=generator)
            target_area = area * float(fval[0])
            fbuf.uniform_(*self.log_ratio, generator=generator).exp_()
            aspect_ratio = float(fval[0])
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                ibuf.random_(0, height - h + 1, generator=generator)
                i = int(ival[0])
                ibuf.random_(0, width - w + 1, generator=generator)
                return i, int(ival[0]), h, w
        return self._fallback(height, width)

    def _draw_items(self, height: int, width: int, generator: torch.Generator | None) -> tuple[int, int, int, int]:
        area = height * width
        buf = torch.empty(1)
        for _ in range(10):
            target_area = area * buf.uniform_(*self.scale, generator=generator).item()
            aspect_ratio = torch.exp(buf.uniform_(*self.log_ratio, generator=generator)).item()
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                i = torch.randint(0, height - h + 1, size=(1,), generator=generator).item()
                j = torch.randint(0, width - w + 1, size=(1,), generator=generator).item()
                return int(i), int(j), h, w
        return self._fallback(height, width)

    def _fallback(self, height: int, width: int) -> tuple[int, int, int, int]:
        ratio = self.ratio
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


def _resize(chw: torch.Tensor, size: list[int], channels_last: bool = False,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """torchvision v2's uint8 bilinear antialiased resize, called without its dispatch layers.

    A CHW view of an HWC array is channels-last, which is what the AVX2 uint8 kernel reads.
    Its result is planar (contiguous CHW) unless ``channels_last``: then it is written
    channels-last, skipping the kernel's planar scatter (the same bytes either way). An image
    already of that size is laid out the same way, so the layout never depends on the image.
    ``out`` (a ``uint8`` CHW tensor of ``size``, e.g. a batch buffer's slot): written there
    instead, in its own layout, and returned. A planar input (a tensor from
    ``torchvision.io.decode_jpeg``) with a channels-last result is made channels-last first: the
    kernel refuses that pair with an internal assert ("num_channels == unpacked_output.size(0)").
    """
    if list(chw.shape[-2:]) == size:
        if out is not None:
            return out.copy_(chw)
        return chw[None].contiguous(memory_format=torch.channels_last)[0] if channels_last else chw.contiguous()
    to_cl = (out.stride(0) == 1 and out.shape[0] > 1) if out is not None else channels_last
    if to_cl and chw.stride(0) != 1 and chw.shape[0] > 1:
        chw = chw[None].contiguous(memory_format=torch.channels_last)[0]
    if out is not None:
        return torch._C._nn._upsample_bilinear2d_aa(chw.unsqueeze(0), size, False, None, out=out.unsqueeze(0))[0]
    # the op ``F.interpolate(..., mode="bilinear", antialias=True)`` ends in, without its ~10 µs of
    # Python argument checks per image (the same kernel, the same bytes: the pixel-contract tests)
    # channels-last through the binding's out= (``torch.ops.aten...out`` is the same kernel behind ~40 µs
    # more of Python dispatch); None: the kernel allocates its planar result
    out = torch.empty((1, chw.shape[0], *size), dtype=chw.dtype, memory_format=torch.channels_last) \
        if channels_last else None
    return torch._C._nn._upsample_bilinear2d_aa(chw.unsqueeze(0), size, False, None, out=out)[0]


def _box_in(sh: int, sw: int, drawn: tuple[int, int, int, int, int, int, bool]) -> tuple[int, int, int, int]:
    """``(y0, x0, y1, x1)``: the crop of ``drawn`` (``TrainTransform.draw``) in its image decoded at ``sh`` x ``sw``,
    rounded outwards (the crop itself at full size: the factors are exactly 1)."""
    h, w, i, j, ch, cw, _ = drawn
    fy, fx = sh / h, sw / w
    return int(i * fy), int(j * fx), min(sh, math.ceil((i + ch) * fy)), min(sw, math.ceil((j + cw) * fx))


def _as_chw(img) -> torch.Tensor:
    """PIL image, HWC ndarray or CHW uint8 tensor → CHW uint8 tensor (a view where possible)."""
    if isinstance(img, torch.Tensor):
        if img.dtype != torch.uint8 or img.dim() != 3:
            raise TypeError(f"expected a uint8 CHW tensor, got {img.dtype} of shape {tuple(img.shape)}")
        return img
    if not isinstance(img, np.ndarray):
        # the image policy's rule, as from_bytes decodes: a 16-bit grayscale image keeps its high byte
        # (Pillow's convert("RGB") clips it, 130 grey levels off on average on a full-range ramp)
        img = np.array(img if img.mode == "RGB" else mode_to_rgb(img))  # a writable copy for torch
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
        channels_last: lay the output out channels-last in memory (same values; see the
            module docstring).
    """

    channels_last = False  # the class default: an instance pickled before the option existed reads it

    def __init__(self, size: int = DEFAULT_SIZE, *, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip_p: float = 0.5,
                 channels_last: bool = False) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if not 0 < scale[0] <= scale[1]:
            raise ValueError(f"scale must be (min, max) with 0 < min <= max, got {scale}")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio must be (min, max) with 0 < min <= max, got {ratio}")
        self.size, self.scale, self.ratio, self.flip_p = size, tuple(scale), tuple(ratio), flip_p
        self.channels_last = bool(channels_last)
        self._rrc = _RRC(self.scale, self.ratio)
        # the flip is compared in float32, as torch's ``rand(1) < p`` compares it, without the ``lt`` op
        self._flip_p32 = float(np.float32(flip_p))

    def crop_box(self, height: int, width: int, generator: torch.Generator | None = None) -> tuple[int, int, int, int]:
        """The next random-resized crop ``(top, left, height, width)`` for an image of that size.

        Drawn exactly as ``from_bytes`` draws it (from ``generator``, else torch's global RNG),
        so another decoder can reproduce the preset's crops.
        """
        return self._rrc(height, width, generator)

    def _finish(self, chw: torch.Tensor, flip: bool, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is not None and not flip:  # straight into the caller's buffer: no copy after
            return _resize(chw, [self.size, self.size], out=out)
        # the Python torch.flip takes no out= (aten::flip.out through torch.ops costs ~40 µs of dispatch): a
        # flipped image is made, then copied by the caller
        res = _resize(chw, [self.size, self.size], self.channels_last)
        return res.flip(-1) if flip else res  # flip keeps the layout (a dense tensor's strides)

    def draw(self, data: bytes, generator: torch.Generator | None = None) -> tuple[int, int, int, int, int, int, bool]:
        """The random draws of one ``from_bytes`` call: ``(height, width, top, left, crop h, crop w, flip)``.

        From ``generator`` when given, else torch's global RNG, in ``from_bytes``' order.
        """
        h, w = image_size(data)
        i, j, ch, cw = self._rrc(h, w, generator)
        return h, w, i, j, ch, cw, self._flip(generator)

    def _flip(self, generator: torch.Generator | None) -> bool:
        """torchvision's flip draw, ``rand(1) < p`` (``rand`` is ``uniform_(0, 1)`` on a fresh tensor),
        on this thread's draw tensor, compared in its dtype."""
        fbuf, fval, _, _ = _draw_buffers()
        if fbuf is None:
            return bool(torch.rand(1, generator=generator) < self.flip_p)
        fbuf.uniform_(0.0, 1.0, generator=generator)
        return float(fval[0]) < (self._flip_p32 if fbuf.dtype == torch.float32 else self.flip_p)

    def decode_crop(self, data: bytes, drawn: tuple[int, int, int, int, int, int, bool]) -> torch.Tensor:
        """The crop of ``drawn`` (from ``draw``) decoded as the preset decodes it, as a CHW view.

        Only as much as the crop needs: the smallest DCT scale that leaves the crop at least
        ``size`` on both sides (its box rounded outwards), else a region decode of the crop.
        """
        h, w, i, j, ch, cw, _ = drawn
        min_h, min_w = math.ceil(h * self.size / ch), math.ceil(w * self.size / cw)
        # the CHW view is made in numpy (transpose, slice) and handed to torch once: a torch
        # ``permute`` or slice would be another GIL release per image
        if 2 * min_h > h or 2 * min_w > w:  # no DCT scale fits: decode just the crop
            return torch.from_numpy(decode_rgb_region(data, i, j, ch, cw).transpose(2, 0, 1))
        d = jpeg_scale(h, w, min_h, min_w)
        if d > 1:  # just the crop's box of the scaled image, where the compiled decoder is built
            y0, x0, y1, x1 = _box_in(math.ceil(h / d), math.ceil(w / d), drawn)
            got = decode_jpeg_scaled_region(data, y0, x0, y1 - y0, x1 - x0, d)
            if got is not None:
                return torch.from_numpy(got.transpose(2, 0, 1))
        arr = decode_rgb_fast(data, min_height=min_h, min_width=min_w, size=(h, w))
        y0, x0, y1, x1 = _box_in(arr.shape[0], arr.shape[1], drawn)  # full size or DCT-scaled, as it came out
        return torch.from_numpy(arr[y0:y1, x0:x1].transpose(2, 0, 1))

    @timed("transform", own=True, per_class=True)
    def from_bytes(self, data: bytes, generator: torch.Generator | None = None, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode only as much as the crop needs, then crop, resize and flip.

        The crop and flip are drawn from ``generator`` when given (the thread pipeline
        gives each sample its own), else from torch's global RNG. ``out``: a ``uint8``
        3 x ``size`` x ``size`` tensor the image may be written into (the thread pipeline
        passes its batch slot); the result is ``out`` when it was, else a new tensor for the
        caller to copy (a flipped image: ``torch.flip`` takes no ``out=``).
        """
        drawn = self.draw(data, generator)
        return self._finish(self.decode_crop(data, drawn), drawn[6], out)

    @timed("transform", own=True, per_class=True)
    def plan(self, data: bytes, generator: torch.Generator | None = None) -> tuple[int, int, int, int, int, int, bool]:
        """``from_bytes`` before the decode: its random draws (``draw``), for ``render``."""
        return self.draw(data, generator)

    @timed("transform", own=True, per_class=True)
    def render(self, data: bytes, plan: tuple[int, int, int, int, int, int, bool], *,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``from_bytes`` after the draws: decode the crop of ``plan``, resize, flip (into ``out`` as there)."""
        return self._finish(self.decode_crop(data, plan), plan[6], out)

    @timed("transform", own=True, per_class=True)
    def __call__(self, img) -> torch.Tensor:
        chw = _as_chw(img)
        i, j, ch, cw = self.crop_box(chw.shape[1], chw.shape[2])
        return self._finish(chw[:, i:i + ch, j:j + cw], self._flip(None))

    def __repr__(self) -> str:
        cl = ", channels_last=True" if self.channels_last else ""
        return f"TrainTransform(size={self.size}, scale={self.scale}, ratio={self.ratio}, flip_p={self.flip_p}{cl})"


class EvalTransform:
    """Resize the shorter side to ``resize``, center-crop ``size``, as a uint8 CHW tensor.

    Same output sizes and crop offsets as ``Compose([Resize(resize), CenterCrop(size)])``.
    ``channels_last=True``: the resized image is written channels-last (same values; see the
    module docstring).
    """

    channels_last = False  # the class default: an instance pickled before the option existed reads it

    def __init__(self, size: int = DEFAULT_SIZE, resize: int = DEFAULT_RESIZE, *, channels_last: bool = False) -> None:
        if size < 1 or resize < size:
            raise ValueError(f"need 1 <= size <= resize, got size={size}, resize={resize}")
        self.size, self.resize = size, resize
        self.channels_last = bool(channels_last)

    def resize_target(self, h: int, w: int) -> list[int]:
        """``[height, width]`` an ``h`` x ``w`` image is resized to before the center crop."""
        if h <= w:
            return [self.resize, int(self.resize * w / h)]
        return [int(self.resize * h / w), self.resize]

    def resize_and_crop(self, chw: torch.Tensor, target: list[int]) -> torch.Tensor:
        """Resize a ``uint8`` CHW image to ``target`` (a no-op when it is that size already), center-crop ``size``."""
        out = _resize(chw, target, self.channels_last)
        top = int(round((target[0] - self.size) / 2.0))
        left = int(round((target[1] - self.size) / 2.0))
        return out[:, top:top + self.size, left:left + self.size]

    @timed("transform", own=True, per_class=True)
    def from_bytes(self, data: bytes, generator: torch.Generator | None = None) -> torch.Tensor:
        """Decode at the smallest DCT scale the resize allows, resize, center-crop.

        ``generator`` is accepted for symmetry with ``TrainTransform`` and unused (no randomness).
        """
        h, w = image_size(data)
        target = self.resize_target(h, w)
        arr = decode_rgb_fast(data, min_height=target[0], min_width=target[1], size=(h, w))
        return self.resize_and_crop(torch.from_numpy(arr).permute(2, 0, 1), target)

    @timed("transform", own=True, per_class=True)
    def __call__(self, img) -> torch.Tensor:
        chw = _as_chw(img)
        return self.resize_and_crop(chw, self.resize_target(chw.shape[1], chw.shape[2]))

    def __repr__(self) -> str:
        cl = ", channels_last=True" if self.channels_last else ""
        return f"EvalTransform(size={self.size}, resize={self.resize}{cl})"


def train_transform(size: int = DEFAULT_SIZE, **kwargs) -> TrainTransform:
    """The training preset: ``TrainTransform(size, scale=..., ratio=..., flip_p=..., channels_last=...)``."""
    return TrainTransform(size, **kwargs)


def eval_transform(size: int = DEFAULT_SIZE, resize: int = DEFAULT_RESIZE, *,
                   channels_last: bool = False) -> EvalTransform:
    """The evaluation preset: ``EvalTransform(size, resize, channels_last=...)``."""
    return EvalTransform(size, resize, channels_last=channels_last)


def _hwc_rows(im: torch.Tensor) -> bool:
    """A CHW tensor laid out channels-last: interleaved pixels, each row dense (a crop of one is too)."""
    return im.stride(0) == 1 and im.stride(2) == im.shape[0]


def uint8_batch_layout(images: Sequence[torch.Tensor]) -> tuple[int, int, int, int, bool]:
    """``(n, c, h, w, channels_last)`` of the batch ``collate_uint8`` stacks ``images`` into.

    Raises:
        TypeError, ValueError: as ``collate_uint8``.
    """
    first = images[0]
    if not isinstance(first, torch.Tensor) or first.dtype != torch.uint8 or first.dim() != 3:
        got = f"{first.dtype} {tuple(first.shape)}" if isinstance(first, torch.Tensor) else type(first).__name__
        raise TypeError(
            f"collate_uint8 expects uint8 CHW tensors, got {got}.\nHINT: use "
            "fastload.train_transform()/eval_transform() (they keep uint8) and normalise on the "
            "device with DevicePrefetcher, instead of ToTensor()/Normalize() in the dataset."
        )
    c, h, w = first.shape
    for im in images:
        if im.shape != first.shape or im.dtype != torch.uint8:
            raise ValueError(f"collate_uint8: images of different shapes/dtypes in one batch: "
                             f"{tuple(first.shape)} {first.dtype} and {tuple(im.shape)} {im.dtype}")
    # channels-last samples (``channels_last=True`` presets) make a channels-last batch, copied without
    # a transpose; anything else a contiguous one
    return len(images), c, h, w, c > 1 and all(_hwc_rows(im) for im in images)


def collate_uint8(batch: Sequence[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``(uint8 CHW, label)`` samples into ``(uint8 NCHW, int64 labels)``, no float on the CPU.

    In a DataLoader worker the batch is built straight in shared memory (as torch's
    ``default_collate`` does), so it reaches the main process without another copy.
    Samples all laid out channels-last (the presets' ``channels_last=True``, or any
    ``from_numpy(hwc).permute(2, 0, 1)``) make a ``torch.channels_last`` batch, copied
    without a transpose; anything else a contiguous one.

    Raises:
        TypeError: a sample is not uint8 — a ``ToTensor()`` in the transform converts to
            float on the CPU, which is the cost this collate exists to avoid.
    """
    images = [b[0] for b in batch]
    n, c, h, w, channels_last = uint8_batch_layout(images)
    first = images[0]
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    if torch.utils.data.get_worker_info() is not None:
        storage = first._typed_storage()._new_shared(n * first.numel(), device=first.device)
        out = first.new(storage).resize_(n, c, h, w)
        if fmt is torch.channels_last:
            out = out.as_strided((n, c, h, w), (c * h * w, 1, w * c, c))
    else:
        out = torch.empty((n, c, h, w), dtype=torch.uint8, memory_format=fmt)
    out = torch.stack(images, 0, out=out)
    labels = torch.as_tensor([int(b[1]) for b in batch], dtype=torch.int64)
    return out, labels


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
              *, dtype: torch.dtype = torch.float32, channels_last: bool = False,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``uint8`` NCHW (0..255) → ``dtype`` normalised by mean/std (given on the 0..1 scale).

    Float input is taken as already in 0..1. Runs wherever ``images`` is: call it on the device.

    ``out``: ``uint8`` images on the CPU only, ``dtype`` float32: a float32 CPU tensor of the
    images' shape, contiguous in the asked memory format, written and returned (no fresh
    38 MB for a batch of 64 at 224 px: ``DevicePrefetcher`` reuses its buffers so).

    Raises:
        ValueError: ``out`` given where it cannot be used, or not of that shape, dtype and layout.
    """
    if out is not None:
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        if not (images.device.type == "cpu" and images.dtype == torch.uint8 and images.dim() == 4
                and dtype == torch.float32):
            raise ValueError("normalize(out=...) takes uint8 NCHW images on the CPU normalised to float32, got "
                             f"{images.dtype} {tuple(images.shape)} on {images.device} to {dtype}")
        if (out.dtype != torch.float32 or out.device.type != "cpu" or out.shape != images.shape
                or not out.is_contiguous(memory_format=fmt)):
            raise ValueError(f"normalize(out=...): expected a float32 CPU tensor of shape {tuple(images.shape)}, "
                             f"contiguous as {fmt}; got {out.dtype} {tuple(out.shape)} on {out.device}")
    if images.device.type == "cpu" and images.dtype == torch.uint8 and images.dim() == 4:
        x = _normalize_cpu(images, mean, std, channels_last, out)
    else:
        images = images.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        scale = 255.0 if images.dtype == torch.uint8 else 1.0
        m, s = _stats(mean, std, scale, images.device)
        x = images.to(torch.float32).sub_(m).div_(s)
    return x if dtype == torch.float32 else x.to(dtype)


def _normalize_cpu(images: torch.Tensor, mean: Sequence[float], std: Sequence[float],
                   channels_last: bool, into: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path in one fused cast-multiply and one add, into ``into`` or memory numpy allocates.

    Measured on a 64×3×224×224 batch, one thread: torch's ``to(float32).sub_().div_()``
    takes ~21 ms, most of it first-touch page faults on the fresh 38 MB output; numpy
    allocates large arrays with transparent huge pages and fuses the cast into the
    multiply: ~8 ms. A layout change (NCHW uint8 in, channels-last float out, or the
    reverse) happens inside that same multiply. Same result to float32 rounding
    (x·(1/σ) − μ/σ instead of (x − μ)/σ).
    """
    n, c, h, w = images.shape
    inv = 1.0 / (255.0 * np.asarray(std, dtype=np.float64))
    scale = inv.astype(np.float32)
    bias = (-np.asarray(mean, dtype=np.float64) * 255.0 * inv).astype(np.float32)
    src = images.numpy() if images.is_contiguous() or images.is_contiguous(memory_format=torch.channels_last) \
        else images.contiguous().numpy()  # numpy views honour torch's strides either way
    if channels_last:  # compute in NHWC order, rows of w*c values (an inner loop of c=3 is slow)
        out = np.empty((n * h, w * c), dtype=np.float32) if into is None \
            else into.permute(0, 2, 3, 1).numpy().reshape(n * h, w * c)
        rows = np.ascontiguousarray(src.transpose(0, 2, 3, 1)).reshape(n * h, w * c)
        np.multiply(rows, np.tile(scale, w), out=out, dtype=np.float32)
        np.add(out, np.tile(bias, w), out=out)
        return torch.from_numpy(out.reshape(n, h, w, c)).permute(0, 3, 1, 2) if into is None else into
    out = np.empty((n, c, h, w), dtype=np.float32) if into is None else into.numpy()
    np.multiply(src, scale.reshape(1, -1, 1, 1), out=out, dtype=np.float32)
    np.add(out, bias.reshape(1, -1, 1, 1), out=out)
    return torch.from_numpy(out) if into is None else into
