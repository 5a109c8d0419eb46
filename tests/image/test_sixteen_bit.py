"""Every 16-bit PNG mode against the documented rule (``image.policy``): the high byte of each
16-bit sample, alpha and tRNS dropped as ``convert("RGB")`` drops them (docs/jpeg-damage.md)."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from fastload.image.policy import decode_rgb, prepare
from helpers import png_chunk

_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def _png16(samples: np.ndarray, colour: int, *, trns: bytes | None = None, interlace: bool = False) -> bytes:
    """A 16-bit PNG written from ``samples`` (H×W×channels uint16) by hand, Adam7 when ``interlace``."""
    h, w = samples.shape[:2]
    passes = _ADAM7 if interlace else ((0, 0, 1, 1),)
    raw = b""
    for x0, y0, dx, dy in passes:
        sub = samples[y0::dy, x0::dx]
        if sub.size:
            raw += b"".join(b"\0" + row.astype(">u2").tobytes() for row in sub)
    chunks = [png_chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, colour, 0, 0, int(interlace)))]
    if trns is not None:
        chunks.append(png_chunk(b"tRNS", trns))
    chunks += [png_chunk(b"IDAT", zlib.compress(raw)), png_chunk(b"IEND", b"")]
    return b"\x89PNG\r\n\x1a\n" + b"".join(chunks)


def _samples(channels: int, seed: int) -> np.ndarray:
    """Smooth ramps plus noise over the whole 16-bit range (and a dark corner whose values are all < 256)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:24, 0:37]
    base = (x * 65535 // 36)[..., None] + rng.integers(-3000, 3000, (24, 37, channels))
    out = np.clip(base, 0, 65535).astype(np.uint16)
    out[:6, :6] = rng.integers(0, 256, (6, 6, channels))
    return out


MODES = {  # name: (colour type, channels, tRNS builder from the samples)
    "gray16 (I;16)": (0, 1, None),
    "gray16+tRNS": (0, 1, lambda s: struct.pack(">H", int(s[3, 3, 0]))),
    "gray16+alpha16": (4, 2, None),
    "RGB48": (2, 3, None),
    "RGB48+tRNS": (2, 3, lambda s: struct.pack(">HHH", *(int(v) for v in s[3, 3]))),
    "RGBA64": (6, 4, None),
}


@pytest.mark.parametrize("interlace", [False, True], ids=["plain", "adam7"])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_16_bit_mode_follows_the_high_byte_rule(mode, interlace):
    colour, channels, trns = MODES[mode]
    samples = _samples(channels, seed=colour + channels)
    data = _png16(samples, colour, trns=trns(samples) if trns else None, interlace=interlace)
    colours = samples[..., :1] if channels <= 2 else samples[..., :3]
    want = np.broadcast_to((colours >> 8).astype(np.uint8), samples.shape[:2] + (3,))
    assert np.array_equal(decode_rgb(data), want)
    exact = prepare(data, lossless=True)
    assert exact.stored_as == "canonicalised" and np.array_equal(decode_rgb(exact.data), want)
    lossy = prepare(data)
    assert np.abs(decode_rgb(lossy.data).astype(int) - want).mean() < 4.0


# ---- every reader, every 16-bit mode (ARCHITECTURE: every stored record decodes, to the same pixels,
# with every decoder fastload reads with) -----------------------------------------------------------


def _tree16(root):
    """One file per 16-bit mode; the tRNS key colour fills a block of pixels (it is present in the image)."""
    files = {}
    for k, (mode, (colour, channels, trns)) in enumerate(MODES.items()):
        samples = _samples(channels, seed=10 + k)
        samples[8:20, 10:30] = samples[3, 3]  # the key colour, where a tRNS names it, covers 240 pixels
        name = f"{k}-{mode.split(' ')[0].replace('+', '-')}.png"
        (root / "a").mkdir(parents=True, exist_ok=True)
        (root / "a" / name).write_bytes(_png16(samples, colour, trns=trns(samples) if trns else None))
        colours = samples[..., :1] if channels <= 2 else samples[..., :3]
        files[f"a/{name}"] = np.ascontiguousarray(np.broadcast_to((colours >> 8).astype(np.uint8),
                                                                  samples.shape[:2] + (3,)))
    return files


class _Exact:
    """A transform with ``from_bytes``: the dataset hands it the stored bytes (the presets' fast path)."""

    def from_bytes(self, data, generator=None):
        import torch

        from fastload.image.fast import decode_rgb_fast

        return torch.from_numpy(decode_rgb_fast(data))


def _mean_diff(a, b) -> float:
    return float(np.abs(np.asarray(a).astype(int) - b).mean())


def test_every_16_bit_mode_reads_the_same_through_every_reader_of_the_originals(tmp_path):
    """The original files: the reference decode, the fast path, serve's preprocessing (bytes) and the
    presets given a PIL image (they used to take Pillow's convert("RGB"), which clips 16-bit grayscale:
    ~130 grey levels off the rule on these images)."""
    from PIL import Image

    from fastload.image.fast import decode_rgb_fast
    from fastload.load.transforms import eval_transform
    from fastload.serve.preprocess import decode_request

    files = _tree16(tmp_path)
    h, w = next(iter(files.values())).shape[:2]
    preset = eval_transform(size=h, resize=h)  # no resampling: the centre h x h crop of the pixels
    left = int(round((w - h) / 2.0))
    for rel, want in files.items():
        data = (tmp_path / rel).read_bytes()
        crop = want[:, left:left + h]
        assert _mean_diff(decode_rgb(data), want) == 0, rel
        assert _mean_diff(decode_rgb_fast(data), want) == 0, rel
        assert _mean_diff(decode_request(preset, data, 10**6).permute(1, 2, 0), crop) == 0, rel
        with Image.open(tmp_path / rel) as img:
            img.load()
            assert _mean_diff(preset(img).permute(1, 2, 0), crop) == 0, (rel, img.mode)


@pytest.mark.slow  # 30-45 s on the loaded 2-core machine: verify's worker processes, DALI's start
@pytest.mark.parametrize("lossless", [False, True], ids=["default", "lossless"])
def test_every_16_bit_mode_reads_the_same_through_every_reader_of_the_store(tmp_path, lossless):
    """Converted (default: JPEG q95 4:4:4; --lossless: PNG), then read by the dataset's PIL path, its fast
    path, the threads backend and every decoder ``verify`` knows (DALI's CPU decoder when installed)."""
    import importlib.util

    from fastload import DataLoader
    from fastload.load.dataset import LMDBImageDataset
    from fastload.pack.convert import ConvertOptions, convert
    from fastload.store.check import verify_store

    files = _tree16(tmp_path / "src")
    store = tmp_path / "store"
    report = convert(tmp_path / "src", store, ConvertOptions(progress=False, workers=1, lossless=lossless))
    assert report.stored == len(files) and not report.skipped
    bound = 4.0 if not lossless else 0.0  # JPEG q95's loss, on average; exact for --lossless
    plain, fast = LMDBImageDataset(store), LMDBImageDataset(store, transform=_Exact())
    rels = [rel for rel, _ in plain.samples]
    assert sorted(rels) == sorted(files)
    for i, rel in enumerate(rels):
        assert _mean_diff(plain[i][0], files[rel]) <= bound, rel
        assert _mean_diff(fast[i][0], files[rel]) <= bound, rel
        assert np.array_equal(np.asarray(plain[i][0]), fast[i][0].numpy()), rel
    loader = DataLoader(fast, batch_size=1, num_workers=2, backend="threads", collate_fn=lambda b: b[0])
    for i, (img, _) in enumerate(loader):
        assert _mean_diff(img, files[rels[i]]) <= bound, rels[i]
    decoders = ("fastload", "pil", "torchvision") + (("dali",) if importlib.util.find_spec("nvidia.dali") else ())
    verified = verify_store(store, decoders=decoders, workers=1)
    assert not verified.failures, verified.failures


@pytest.mark.dali
def test_dali_cpu_on_the_16_bit_originals_is_within_one_level_of_the_rule(tmp_path):
    """DALILoader reading a folder decodes the original files: DALI scales 16-bit samples (v * 255 / 65535,
    rounded) where fastload keeps the high byte: at most 1 level apart, never more."""
    from fastload.store.check import _Decoders

    dec = _Decoders()
    for rel, want in _tree16(tmp_path).items():
        got = dec.decode("dali", (tmp_path / rel).read_bytes())
        assert got.shape == want.shape and np.abs(got.astype(int) - want).max() <= 1, rel
