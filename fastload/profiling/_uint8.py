"""``--verify-fix``'s uint8 presets on a torchvision ``ImageFolder``, applied from outside the script.

Owns: translating the dataset's torchvision transform chain into a fastload preset and the
mean/std it normalises with (only chains the presets reproduce; anything else is refused with a
reason that names the transform), the copy of the dataset that reads each file's bytes and
decodes/crops/resizes with the preset (``from_bytes``: DCT-scaled or region decode), the swap of
that copy and ``collate_uint8`` into the training loader before its iterator starts, and the batch
wrap that hands the user's unmodified loop the batch it had: float32, normalised with its
mean/std, the same shape, int64 labels. The conversion runs on the CUDA device when this process
uses one (``DevicePrefetcher``'s side-stream copy, the batch is then on that device), else in the
training process right after each batch arrives: without CUDA the normalising moves from the
loader's workers into the training process. Also what the store advice needs of such a dataset
(``describe``: its folder, a few of its files, the preset or why none) and the preset's CPU time
per sample on those files, timed in the profiler's own process after the run (``time_presets``).

What is translated (torchvision v1 or v2 classes, nested ``Compose`` flattened):
``RandomResizedCrop(s)`` [+ ``RandomHorizontalFlip(p)``] -> ``train_transform(s, scale, ratio, flip_p)``;
``Resize(r)`` + ``CenterCrop(s)`` -> ``eval_transform(s, r)``; bilinear only, square crops, ``Resize``
of the shorter side (an int) without ``max_size``; then ``ToTensor()``, ``PILToTensor()`` +
``ConvertImageDtype(torch.float32)`` or ``ToImage()`` + ``ToDtype(torch.float32, scale=True)``,
optionally ``Normalize(mean, std)`` (none: mean 0, std 1).

Must not: import torch or torchvision at import time (the probe imports this module only when it
applies the change); change the user's dataset object (a copy is swapped in, so another loader over
the same dataset keeps its batches).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

GEOMETRY = ("RandomResizedCrop", "RandomHorizontalFlip", "Resize", "CenterCrop")
TO_UINT8_TENSOR = ("PILToTensor", "ToImage")  #: uint8 tensors, no scaling: the presets' own output type


class NotTranslatable(Exception):
    """The change cannot be made on this loader; the message says why (and names the transform)."""


@dataclass(frozen=True)
class Translation:
    """A preset that reproduces the dataset's transform up to its float conversion, and its normalisation."""

    preset: Any  #: ``TrainTransform`` or ``EvalTransform``
    mean: tuple[float, ...]
    std: tuple[float, ...]
    replaced: str  #: the user's chain, as names


class ReadBytes:
    """The dataset's ``loader``: a file's bytes (the preset decodes them). Picklable for spawned workers."""

    def __call__(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def __repr__(self) -> str:
        return "ReadBytes()"


class FromBytes:
    """The dataset's ``transform``: the preset's ``from_bytes`` (decode only what the crop needs)."""

    def __init__(self, preset: Any) -> None:
        self.preset = preset

    def __call__(self, data: bytes):
        return self.preset.from_bytes(data)

    def __repr__(self) -> str:
        return f"FromBytes({self.preset!r})"


def _name(t: Any) -> str | None:
    """The torchvision transform class's name, None for anything else (a user's subclass included)."""
    cls = type(t)
    return cls.__name__ if cls.__module__.startswith("torchvision.transforms") else None


def _show(t: Any) -> str:
    text = repr(t).replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."


def _flatten(transform: Any) -> list[Any]:
    if _name(transform) == "Compose":
        return [s for t in transform.transforms for s in _flatten(t)]
    return [transform]


def _side(size: Any, what: Any) -> int:
    """A square side from a transform's ``size`` (int, [s] or (s, s))."""
    if isinstance(size, int):
        return size
    if isinstance(size, Sequence) and len(size) in (1, 2) and all(isinstance(x, int) for x in size) \
            and size[0] == size[-1]:
        return int(size[0])
    raise NotTranslatable(f"{_show(what)}: the presets make square images of one side")


def _bilinear(t: Any) -> None:
    """Refuse a resize the presets' antialiased bilinear one does not reproduce (v1 stores an
    ``InterpolationMode``, v2 may keep the string or PIL's int it was given)."""
    from torchvision.transforms import InterpolationMode

    mode = getattr(t, "interpolation", "bilinear")
    mode = mode.value if isinstance(mode, InterpolationMode) else mode
    if mode not in ("bilinear", 2) or getattr(t, "antialias", True) is False:  # 2: PIL's Image.BILINEAR
        raise NotTranslatable(f"{_name(t)} with interpolation={mode!r}, antialias={getattr(t, 'antialias', None)}: "
                              "the presets resize bilinearly, antialiased, only")


def _preset(geometry: list[Any]) -> Any:
    from fastload.load.transforms import EvalTransform, TrainTransform

    names = [_name(t) for t in geometry]
    for t in geometry:
        _bilinear(t)
    if names in (["RandomResizedCrop"], ["RandomResizedCrop", "RandomHorizontalFlip"]):
        rrc = geometry[0]
        flip = float(geometry[1].p) if len(geometry) == 2 else 0.0
        return TrainTransform(_side(rrc.size, rrc), scale=tuple(rrc.scale), ratio=tuple(rrc.ratio), flip_p=flip)
    if names == ["Resize", "CenterCrop"]:
        resize, crop = geometry
        size = resize.size
        if isinstance(size, Sequence) and len(size) == 1:
            size = size[0]
        if not isinstance(size, int) or getattr(resize, "max_size", None) is not None:
            raise NotTranslatable(f"{_show(resize)}: the eval preset resizes the shorter side to an int "
                                  "(no max_size)")
        side = _side(crop.size, crop)
        if side > size:
            raise NotTranslatable(f"{_show(crop)} after {_show(resize)}: the eval preset crops inside the resize")
        return EvalTransform(side, size)
    shown = " + ".join(str(n) for n in names) or "no crop or resize"
    raise NotTranslatable(f"{shown}: the presets reproduce RandomResizedCrop (+ RandomHorizontalFlip) or "
                          "Resize(int) + CenterCrop, nothing else")


def translate(transform: Any) -> Translation:
    """The preset and mean/std that reproduce ``transform`` (a torchvision chain ending in float32).

    Raises:
        NotTranslatable: a transform (named in the message) the presets do not reproduce, or a chain
            whose output is not a float32 image.
    """
    import torch

    if transform is None:
        raise NotTranslatable("the dataset has no transform: its samples are PIL images, not float tensors")
    steps = _flatten(transform)
    geometry: list[Any] = []
    to_float = normalised = False
    mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    std: tuple[float, ...] = (1.0, 1.0, 1.0)
    for t in steps:
        name = _name(t)
        if name in GEOMETRY and not to_float:
            geometry.append(t)
        elif name in TO_UINT8_TENSOR and not to_float:
            continue
        elif name == "ToTensor" and not to_float:
            to_float = True
        elif name == "ConvertImageDtype" and not to_float and t.dtype == torch.float32:
            to_float = True
        elif name == "ToDtype" and not to_float and t.dtype == torch.float32 and getattr(t, "scale", False):
            to_float = True
        elif name == "Normalize" and to_float and not normalised:
            mean, std = tuple(float(x) for x in t.mean), tuple(float(x) for x in t.std)
            if len(mean) == 1 and len(std) == 1:
                mean, std = mean * 3, std * 3
            if len(mean) != 3 or len(std) != 3:
                raise NotTranslatable(f"{_show(t)}: the presets make 3-channel RGB images")
            normalised = True
        else:
            where = "after the float conversion" if to_float else "before the float conversion"
            raise NotTranslatable(f"{_show(t)} ({where}) in the dataset's transform: the uint8 presets do not "
                                  "reproduce it")
    if not to_float:
        raise NotTranslatable("the dataset's transform has no ToTensor/ConvertImageDtype/ToDtype(float32, "
                              "scale=True): its batches are not float, so there is nothing to move")
    preset = _preset(geometry)
    return Translation(preset, mean, std, " + ".join(str(_name(t)) for t in steps))


def _own_getitem(cls: type, base: type) -> bool:
    fn = cls.__getitem__
    while hasattr(fn, "__wrapped__"):  # the profiler's own timing wrap
        fn = fn.__wrapped__
    return fn is base.__getitem__


def _folder_class() -> type:
    from torchvision.datasets import DatasetFolder

    return DatasetFolder


def swap_dataset(dataset: Any) -> tuple[Any, Translation]:
    """A copy of ``dataset`` (a torchvision ``DatasetFolder``, possibly inside ``Subset``\\ s) that reads
    bytes and applies the preset, and the translation.

    Raises:
        NotTranslatable: not such a dataset, its own loader or ``target_transform``, or its transform.
    """
    from torch.utils.data import Subset

    if isinstance(dataset, Subset):
        inner, translation = swap_dataset(dataset.dataset)
        outer = copy.copy(dataset)
        outer.dataset = inner
        return outer, translation
    cls = type(dataset)
    where = f"{cls.__module__}.{cls.__qualname__}"
    if "torchvision" not in sys.modules or not isinstance(dataset, _folder_class()):
        raise NotTranslatable(f"the training loader's dataset is {where}, not a torchvision ImageFolder/"
                              "DatasetFolder: make the change by hand (uint8_snippet in the recommendation)")
    from torchvision.datasets import DatasetFolder
    from torchvision.datasets.folder import default_loader, pil_loader

    if not _own_getitem(cls, DatasetFolder):
        raise NotTranslatable(f"{where} overrides __getitem__: what it does with the image is unknown")
    if dataset.loader not in (default_loader, pil_loader):
        raise NotTranslatable(f"the dataset's loader {getattr(dataset.loader, '__name__', dataset.loader)!r} is "
                              "not torchvision's default (PIL, RGB)")
    from torchvision import get_image_backend

    if get_image_backend() != "PIL":
        raise NotTranslatable(f"torchvision's image backend is {get_image_backend()!r}, not PIL")
    if dataset.target_transform is not None:
        raise NotTranslatable(f"the dataset's target_transform {_show(dataset.target_transform)}: collate_uint8 "
                              "needs int labels")
    translation = translate(dataset.transform)
    swapped = copy.copy(dataset)
    swapped.loader, swapped.transform = ReadBytes(), FromBytes(translation.preset)
    return swapped, translation


def batch_device() -> tuple[Any, str]:
    """Where the batches are converted: this process's CUDA device when it uses one, else the CPU."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device())
        return device, str(device)
    return torch.device("cpu"), "main process"


class Uint8Batches:
    """The loader's iterator, its ``(uint8 NCHW, int64)`` batches turned into ``(float32 normalised, int64)``
    (``DevicePrefetcher``: on CUDA a side-stream copy one batch ahead; on the CPU in the calling thread,
    ``ahead=False``, as the prediction it verifies assumes: ``_recommend.py`` adds the normalising to the
    step, where ``DevicePrefetcher``'s default would overlap it with the step on a helper thread, so the
    CPU figure is the lower one). Attributes (``_workers``, ...) are the inner iterator's, so the probe
    still sees the worker pids."""

    def __init__(self, inner: Any, device: Any, mean: Sequence[float], std: Sequence[float]) -> None:
        from fastload.load.prefetch import DevicePrefetcher

        self._inner = inner
        # the CPU batches converted when the step asks, as the model predicts them; CUDA as DevicePrefetcher does
        import torch

        ahead = torch.device(device).type == "cuda"
        self._out = iter(DevicePrefetcher(inner, device, mean=mean, std=std, ahead=ahead))

    def __iter__(self) -> Uint8Batches:
        return self

    def __next__(self) -> Any:
        return list(next(self._out))  # default_collate gives ImageFolder's (image, label) samples as a list

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_inner"], name)


def apply(loader: Any) -> tuple[dict[str, Any], Any]:
    """Swap the uint8 path into ``loader`` (before its iterator starts); return what was applied, as recorded
    in the probe file, and the function that wraps each of its iterators.

    Raises:
        NotTranslatable: the loader, its dataset or its transform cannot take the change (why, by name).
    """
    from torch.utils.data._utils.collate import default_collate

    from fastload.load.transforms import collate_uint8

    if not getattr(loader, "_auto_collation", False):
        raise NotTranslatable("the loader has batch_size=None (no automatic batching): collate_uint8 batches")
    if loader.collate_fn is not default_collate:
        raise NotTranslatable(f"the loader's collate_fn {getattr(loader.collate_fn, '__name__', loader.collate_fn)!r}"
                              " is the script's own, not torch's default_collate")
    dataset, translation = swap_dataset(loader.dataset)
    object.__setattr__(loader, "dataset", dataset)  # DataLoader refuses `dataset =` after __init__
    loader.collate_fn = collate_uint8
    device, where = batch_device()
    info = {"transform": repr(translation.preset), "replaced": translation.replaced,
            "mean": list(translation.mean), "std": list(translation.std), "normalise": where}

    def wrap(iterator: Any) -> Uint8Batches:
        return Uint8Batches(iterator, device, translation.mean, translation.std)

    return info, wrap



SAMPLE_FILES = 8  #: the user's own images the profiler times the presets on (spread over the dataset)


def _folder_of(dataset: Any) -> Any:
    """The torchvision ``DatasetFolder`` under any ``Subset``\\ s, or None."""
    from torch.utils.data import Subset

    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    if "torchvision" not in sys.modules or not isinstance(dataset, _folder_class()):
        return None
    return dataset


def describe(dataset: Any) -> dict[str, Any] | None:
    """What the store advice needs of a torchvision ``ImageFolder`` (probe side, as the loader is first seen):
    its root folder, a few of its files, and the preset that reproduces its transform (``preset``: the
    keywords of ``train_transform``/``eval_transform``) or why none does (``refused``). None: not such a dataset.
    """
    folder = _folder_of(dataset)
    if folder is None:
        return None
    samples = getattr(folder, "samples", None) or []
    step = max(1, len(samples) // SAMPLE_FILES)
    info: dict[str, Any] = {"root": str(folder.root), "images": len(samples),
                            "files": [str(p) for p, _ in samples[::step][:SAMPLE_FILES]]}
    try:
        _, t = swap_dataset(dataset)
    except NotTranslatable as exc:
        return {**info, "refused": str(exc)}
    p = t.preset
    preset = ({"kind": "train", "size": p.size, "scale": list(p.scale), "ratio": list(p.ratio), "flip_p": p.flip_p}
              if hasattr(p, "flip_p") else {"kind": "eval", "size": p.size, "resize": p.resize})
    return {**info, "preset": preset, "repr": repr(p), "mean": list(t.mean), "std": list(t.std)}


def make_preset(spec: dict[str, Any]) -> Any:
    """The preset ``describe`` recorded (``{"kind": "train" | "eval", ...}``)."""
    from fastload.load.transforms import eval_transform, train_transform

    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in spec.items() if k not in ("kind", "size")}
    return (train_transform if spec["kind"] == "train" else eval_transform)(spec["size"], **kw)


def time_presets(files: Sequence[str], spec: dict[str, Any], *, repeats: int = 3) -> dict[str, Any] | None:
    """CPU milliseconds per sample of the preset on the user's own files, measured in this process (the
    profiler's, after the run): ``store_ms`` on the bytes ``fastload convert`` would store for each file
    (``image.policy.prepare``'s defaults), ``files_ms`` on the files' own bytes (what ``--verify-fix``
    applies), and ``normalise_ms``: one sample's uint8-to-normalised-float conversion on the CPU. None when
    no file could be read or prepared.
    """
    import time

    import torch

    from fastload.image.policy import prepare
    from fastload.load.transforms import normalize

    preset = make_preset(spec)
    pairs = []
    for path in files:
        try:
            with open(path, "rb") as f:
                raw = f.read()
            pair = (raw, prepare(raw).data)
            for data in pair:  # a file the preset cannot read (the store's reader would skip or name it)
                preset.from_bytes(data)
            pairs.append(pair)
        except Exception:  # noqa: BLE001 - any file the user has: advice only, never the profile
            continue
    if not pairs:
        return None
    gen = torch.Generator().manual_seed(0)

    def per_sample(which: int) -> float:
        t0 = time.process_time()
        for pair in pairs:  # once untimed: first-call costs (imports, decoder set-up) are not per sample
            preset.from_bytes(pair[which], gen)
        rounds = repeats if time.process_time() - t0 < 0.5 else 1  # large photos: one timed pass is enough
        t0 = time.process_time()
        for _ in range(rounds):
            for pair in pairs:
                preset.from_bytes(pair[which], gen)
        return (time.process_time() - t0) / (rounds * len(pairs)) * 1e3

    batch = torch.stack([preset.from_bytes(p[1], gen) for p in pairs])
    normalize(batch)
    t0 = time.process_time()
    for _ in range(repeats):
        normalize(batch)
    norm = (time.process_time() - t0) / (repeats * len(pairs)) * 1e3
    return {"store_ms": per_sample(1), "files_ms": per_sample(0), "normalise_ms": norm, "files": len(pairs)}
