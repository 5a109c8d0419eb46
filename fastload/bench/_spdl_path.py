"""The SPDL path of ``fastload bench loader``: Meta's SPDL thread pipeline on the original files.

Owns: whether SPDL can run here (and the install hint when not), and a loader built the way
SPDL's own examples build one, held to the batch contract every other path meets.

A fair configuration, as SPDL intends it to be used:

* ``spdl.pipeline.PipelineBuilder``: a source of ``(path, label)`` from torchvision's
  ``ImageFolder`` (the files and class indices the torchvision path reads), reshuffled
  every epoch, ``continuous`` so one pipeline serves every epoch (as persistent workers
  do); ``aggregate(batch_size, drop_last=True)`` of the paths, then one ``pipe`` stage in
  SPDL's thread pool with ``concurrency`` = the worker count that decodes a batch's files
  and copies them into one batch buffer (``spdl.io.convert_frames``) — the shape of SPDL's
  ``image_dataloading`` example, and ~20% faster here than a task per image followed by a
  collate stage (the event loop's per-task cost); ``build(num_threads=workers)``, so no
  more threads than the other paths have workers; a sink of ``2 × workers`` batches
  (torch's ``prefetch_factor`` of 2 per worker);
* decoding with ``spdl.io.demux_image`` + ``decode_packets``, and the crop, resize and
  flip done where SPDL intends: in FFmpeg's filter graph of the decode
  (``crop=…,scale=S:S:flags=bilinear[,hflip],format=rgb24``), so only the crop is
  resized and the colour conversion rides on the same swscale pass; the crop box is drawn
  with fastload's ``RandomResizedCrop`` sampler (torchvision's distribution: scale
  0.08–1, ratio 3/4–4/3) from the size the demuxer reports, and flipped with p = 0.5;
* ``uint8`` NHWC batches (viewed as NCHW) and ``int64`` labels leave the pipeline; the
  conversion to ``float32`` normalised with the ImageNet mean/std happens on the CPU in
  the main process, inside the timed loop (``DevicePrefetcher``'s helper thread, one batch
  ahead), exactly as for the fastload paths.

Every decode failure stops the pipeline (``max_failures=0``) and the bench reports the
path skipped with the reason, as it does for a path that cannot read a file.

Must not: import SPDL at module level (it is optional; ``unavailable()`` says why not).
"""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fastload.measure.stages import BuiltStage

__all__ = ["SPDL_INSTALL_HINT", "unavailable", "SPDLLoader", "spdl_stage", "folder_samples"]

SPDL_INSTALL_HINT = ("pip install 'fastload[spdl]', plus FFmpeg's shared libraries, 4 to 9: "
                     "apt-get install ffmpeg")


def unavailable() -> str | None:
    """Why the SPDL path cannot run here (not installed, or its FFmpeg libraries missing), or None."""
    try:
        if importlib.util.find_spec("spdl") is None or importlib.util.find_spec("spdl.io") is None:
            return f"spdl is not installed: {SPDL_INSTALL_HINT}"
    except (ImportError, ValueError):
        return f"spdl is not installed: {SPDL_INSTALL_HINT}"
    try:
        import spdl.io.utils
        import spdl.pipeline  # noqa: F401

        spdl.io.utils.get_ffmpeg_versions()  # loads the extension, and with it FFmpeg's libraries
    except Exception as exc:  # ImportError, or RuntimeError("Failed to import libspdl ... libavutil.so...")
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"spdl cannot load FFmpeg ({type(exc).__name__}: {first[:160]}): {SPDL_INSTALL_HINT}"
    return None


class _Epochs:
    """The pipeline's source: every ``(path, label)`` once per epoch, in a new order each epoch."""

    def __init__(self, samples: list[tuple[str, int]], seed: int) -> None:
        self.samples, self.seed, self.epoch = samples, seed, 0

    def __iter__(self) -> Iterator[tuple[str, int]]:
        order = torch.randperm(len(self.samples), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        self.epoch += 1
        return (self.samples[i] for i in order.tolist())


class SPDLLoader:
    """Batches of ``(uint8 NCHW view of NHWC images, int64 labels)`` from an SPDL pipeline.

    Iterate once per epoch; ``close()`` stops the pipeline's threads.
    """

    def __init__(self, samples: list[tuple[str, int]], *, batch_size: int, image_size: int, threads: int,
                 seed: int = 0, timeout_s: float = 120.0) -> None:
        from fastload.load.transforms import train_transform

        if not samples:
            raise ValueError("no images to load")
        self.samples, self.batch_size, self.size = samples, batch_size, image_size
        self.threads, self.timeout_s = max(1, threads), timeout_s
        preset = train_transform(image_size)
        self._crop, self._flip_p = preset.crop_box, preset.flip_p  # the sampler every other path draws from
        self._source = _Epochs(samples, seed)
        self._pipeline: Any = None
        self._error: str | None = None  # the first file SPDL failed on, for the message

    def __len__(self) -> int:
        return len(self.samples) // self.batch_size

    def _filter(self, height: int, width: int) -> str:
        i, j, h, w = self._crop(height, width)
        flip = ",hflip" if torch.rand(1).item() < self._flip_p else ""
        return (f"crop=w={w}:h={h}:x={j}:y={i}:exact=1,scale=w={self.size}:h={self.size}:flags=bilinear"
                f"{flip},format=pix_fmts=rgb24")

    def _decode(self, path: str) -> Any:
        import spdl.io

        try:
            packets = spdl.io.demux_image(path)
            return spdl.io.decode_packets(packets, filter_desc=self._filter(packets.height, packets.width))
        except Exception as exc:
            self._error = self._error or f"SPDL could not decode {path}: {type(exc).__name__}: {exc}"
            raise

    def _load_batch(self, items: list[tuple[str, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One task of the thread pool: decode a batch's files, then one copy into the batch buffer
        (``spdl.io.load_image_batch``'s steps, with a crop of its own for each image)."""
        import spdl.io

        frames = [self._decode(path) for path, _ in items]
        images = spdl.io.to_torch(spdl.io.convert_frames(frames))  # N, H, W, C uint8
        return images.permute(0, 3, 1, 2), torch.tensor([label for _, label in items], dtype=torch.int64)

    def _build(self):
        from spdl.pipeline import PipelineBuilder

        return (PipelineBuilder()
                .add_source(self._source, continuous=True)
                .aggregate(self.batch_size, drop_last=True)
                .pipe(self._load_batch, concurrency=self.threads, name="decode_crop_flip_batch")
                .add_sink(2 * self.threads)
                .build(num_threads=self.threads, max_failures=0))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._pipeline is None:
            self._pipeline = self._build()
            self._pipeline.start()
        try:
            yield from self._pipeline.get_iterator(timeout=self.timeout_s)
        except Exception as exc:  # SPDL's PipelineFailure names the stage; say which file
            if self._error is None:
                raise
            raise RuntimeError(self._error) from exc
        if self._error is not None:  # a failure can also end SPDL's epoch early, without raising
            raise RuntimeError(self._error)

    def close(self) -> None:
        """Stop the pipeline and join its threads (a failure it already raised is not raised again)."""
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is None:
            return
        try:
            pipeline.stop()
        except Exception:
            if self._error is None:
                raise
        finally:
            del pipeline
            gc.collect()  # SPDL's stopped pipeline sits in a reference cycle holding the batches it had
            # buffered; collected now, they are freed before the next path is timed (and not reported
            # by nanobind as leaked at interpreter exit)


def folder_samples(folder: Path) -> list[tuple[str, int]]:
    """``(path, class index)`` of every image of an ImageFolder tree, as torchvision lists them."""
    from torchvision.datasets import ImageFolder

    return list(ImageFolder(str(folder)).samples)


def spdl_stage(samples: list[tuple[str, int]], *, batch_size: int, image_size: int, workers: int,
               seed: int = 0, uint8: bool = False, channels_last: bool = False) -> BuiltStage:
    """The SPDL loader behind the hand-off every path shares: ``DevicePrefetcher`` on the CPU,
    which normalises the ``uint8`` batches on its helper thread, one batch ahead, inside the timed loop
    (``uint8``: not normalised, made contiguous NCHW by ``stages.Uint8Batches``, as every path's are;
    ``channels_last``: kept channels-last, as SPDL's batches come)."""
    from fastload.load.prefetch import DevicePrefetcher
    from fastload.measure.stages import Uint8Batches

    threads = max(1, workers)
    loader = SPDLLoader(samples, batch_size=batch_size, image_size=image_size, threads=threads, seed=seed)
    if uint8:
        return BuiltStage("spdl", Uint8Batches(loader, "cpu", channels_last=channels_last), threads,
                          "not normalised (uint8 batches)")
    prefetcher = DevicePrefetcher(loader, "cpu", dtype=torch.float32, channels_last=channels_last)
    return BuiltStage("spdl", prefetcher, threads,
                      "main process, a helper thread one batch ahead (DevicePrefetcher on CPU)")
