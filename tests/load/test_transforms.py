"""fastload.load.transforms: torchvision's crop geometry, eval equivalence, uint8 collate, normalize."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.v2 as T2
from PIL import Image

from fastload.load.transforms import (IMAGENET_MEAN, IMAGENET_STD, EvalTransform, TrainTransform, collate_uint8,
                                      normalize, rrc_params)
from helpers import jpeg_bytes, photo, png_bytes


@pytest.mark.parametrize("hw", [(375, 500), (500, 333), (224, 224), (64, 900), (1200, 80)])
def test_crop_boxes_are_torchvisions_under_the_same_seed(hw):
    dummy = torch.empty(3, *hw)
    for seed in range(200):
        torch.manual_seed(seed)
        ours = rrc_params(*hw)
        torch.manual_seed(seed)
        theirs = T.RandomResizedCrop.get_params(dummy, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3))
        assert ours == tuple(theirs)


def test_crop_statistics_follow_scale_and_ratio():
    torch.manual_seed(0)
    boxes = np.array([rrc_params(1000, 1000, (0.2, 0.6), (0.5, 2.0)) for _ in range(3000)])
    area = boxes[:, 2] * boxes[:, 3] / 1e6
    ratio = boxes[:, 3] / boxes[:, 2]
    assert 0.19 < area.min() and area.max() < 0.61 and abs(area.mean() - 0.4) < 0.01
    assert 0.49 < ratio.min() and ratio.max() < 2.01
    assert abs(np.log(ratio).mean()) < 0.03  # log-uniform aspect ratio, as torchvision draws it


def test_train_from_bytes_equals_torchvision_v2_on_the_decoded_image():
    data = jpeg_bytes(photo(300, 260, seed=1))
    tv = T2.Compose([T2.RandomResizedCrop(112, antialias=True), T2.RandomHorizontalFlip()])
    decoded = torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB"))).permute(2, 0, 1)
    ours = TrainTransform(112)
    exact = 0
    for seed in range(30):
        torch.manual_seed(seed)
        _, _, h, w = rrc_params(260, 300)
        torch.manual_seed(seed)
        a = ours.from_bytes(data)
        torch.manual_seed(seed)
        b = tv(decoded)
        assert a.dtype == torch.uint8 and a.shape == (3, 112, 112) and a.is_contiguous()
        scaled = 130 >= 260 * 112 / h and 150 >= 300 * 112 / w  # crop >= 2x output: 1/2-scale decode
        if scaled:
            assert (a.int() - b.int()).abs().float().mean() < 4
        else:
            assert torch.equal(a, b)
            exact += 1
    assert exact >= 20


def test_draw_and_decode_crop_are_from_bytes_split_in_two():
    """``bench loader``'s decode floor decodes ``draw``'s crops with ``decode_crop``: the same draws (the
    flip compared in float32, as torch's ``rand(1) < p``, also at a p float32 cannot hold) and pixels."""
    t = TrainTransform(64, flip_p=0.3)
    for data in (jpeg_bytes(photo(300, 260, seed=2)), jpeg_bytes(photo(900, 700, seed=3)), png_bytes(photo(90, 70))):
        for seed in range(40):
            h, w, i, j, ch, cw, flip = t.draw(data, torch.Generator().manual_seed(seed))
            g = torch.Generator().manual_seed(seed)
            assert (i, j, ch, cw) == t.crop_box(h, w, g)
            assert flip == bool(torch.rand(1, generator=g) < 0.3)
            g = torch.Generator().manual_seed(seed)
            drawn = t.draw(data, g)
            crop = t.decode_crop(data, drawn)
            out = torch.nn.functional.interpolate(crop[None], size=[64, 64], mode="bilinear", antialias=True)[0]
            expect = out.flip(-1) if flip else out
            assert torch.equal(t.from_bytes(data, torch.Generator().manual_seed(seed)), expect)


def test_train_preset_calls_few_torch_ops_per_image():
    """Each torch op called from Python releases and retakes the GIL: a hand-off to another thread of
    the thread pipeline. The preset draws with ``uniform_``/``random_`` on per-thread tensors read
    through numpy, and builds the crop's view in numpy: 6 ops for the draws and at most 5 for the
    rest per image (it was 18-20: an ``item`` per draw, fresh tensors, ``exp``, ``randint``, ``rand``,
    ``permute``)."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") != "__get__":  # attribute reads (shape, dtype) are not ops
                self.calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    t = TrainTransform(64)
    t.from_bytes(jpeg_bytes(photo(40, 40)))  # this thread's draw tensors are made once, on its first image
    for data in (jpeg_bytes(photo(300, 260, seed=2)), jpeg_bytes(photo(900, 700, seed=3))):
        for seed in range(6):
            g = torch.Generator().manual_seed(seed)
            with Count() as c:
                t.from_bytes(data, g)
            draws = [f for f in c.calls if f in ("uniform_", "exp_", "random_")]
            rest = [f for f in c.calls if f not in ("uniform_", "exp_", "random_")]
            # per box tried (torchvision tries again when it does not fit): uniform_, uniform_, exp_;
            # then two random_ for the offsets and one uniform_ for the flip
            assert len(draws) % 3 == 0 and c.calls.count("random_") == 2, c.calls
            assert len(rest) <= 5, c.calls  # the resize, its unsqueeze and [0], the batch-slot view, the flip


def test_train_on_large_jpeg_uses_scaled_decode_and_keeps_the_geometry():
    img = photo(1600, 1200, seed=2)
    data = jpeg_bytes(img)
    t = TrainTransform(64, scale=(0.5, 0.5), ratio=(1.0, 1.0), flip_p=0.0)
    torch.manual_seed(0)
    i, j, h, w = rrc_params(1200, 1600, (0.5, 0.5), (1.0, 1.0))
    torch.manual_seed(0)
    out = t.from_bytes(data).int()
    full = torch.from_numpy(np.array(img)).permute(2, 0, 1)
    ref = T2.functional.resize(full[:, i:i + h, j:j + w], [64, 64], antialias=True).int()
    assert (out - ref).abs().float().mean() < 4  # same region; DCT-domain downscale differs slightly


def test_eval_matches_torchvision_resize_centercrop():
    ref = T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor()])
    for seed, (w, h) in enumerate([(500, 375), (333, 500), (256, 256), (300, 900)]):
        data = jpeg_bytes(photo(w, h, seed=seed))
        ours = EvalTransform(224, 256).from_bytes(data).int()
        theirs = ref(Image.open(io.BytesIO(data)).convert("RGB")).int()
        assert ours.shape == theirs.shape == (3, 224, 224)
        assert (ours - theirs).abs().max() <= 1  # documented: at most 1 at full-size decode


def test_eval_on_png_and_pil_input():
    img = photo(320, 240, seed=4)
    ours = EvalTransform(96, 128)
    a = ours.from_bytes(png_bytes(img))
    b = ours(img)
    assert torch.equal(a, b) and a.shape == (3, 96, 96)


def test_presets_validate_arguments():
    with pytest.raises(ValueError, match="size"):
        EvalTransform(224, 200)
    with pytest.raises(ValueError, match="scale"):
        TrainTransform(224, scale=(0.5, 0.1))


def test_collate_uint8_and_its_hint():
    batch = [(torch.full((3, 4, 4), i, dtype=torch.uint8), i) for i in range(5)]
    images, labels = collate_uint8(batch)
    assert images.dtype == torch.uint8 and images.shape == (5, 3, 4, 4)
    assert labels.dtype == torch.int64 and labels.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(TypeError, match="ToTensor"):
        collate_uint8([(torch.zeros(3, 4, 4), 0)])


def test_normalize_equals_totensor_normalize():
    img = photo(40, 30, seed=6)
    ref = T.Compose([T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])(img)
    u8 = torch.from_numpy(np.array(img)).permute(2, 0, 1)[None]
    out = normalize(u8)
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)
    cl = normalize(u8, dtype=torch.bfloat16, channels_last=True)
    assert cl.dtype == torch.bfloat16 and cl.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(cl.float(), out, atol=0.02, rtol=0.01)


@pytest.mark.parametrize("backend", ["auto", "full-decode"])
def test_region_decode_equals_crop_of_full_decode(backend, monkeypatch):
    import fastload.image.fast as dec

    if backend == "full-decode":
        monkeypatch.setattr(dec, "_region_decoder", lambda: None)
    data = jpeg_bytes(photo(333, 250, seed=8))
    full = dec.decode_rgb_fast(data)
    for top, left, h, w in [(0, 0, 250, 333), (17, 31, 101, 77), (249, 332, 1, 1), (8, 16, 64, 64)]:
        got = dec.decode_rgb_region(data, top, left, h, w)
        np.testing.assert_array_equal(got, full[top:top + h, left:left + w])
    png = png_bytes(photo(40, 30, seed=9))
    np.testing.assert_array_equal(dec.decode_rgb_region(png, 3, 4, 10, 12), dec.decode_rgb_fast(png)[3:13, 4:16])


def test_region_decode_of_corrupt_jpeg_raises_badimage():
    from fastload.image.fast import decode_rgb_region
    from fastload.image.policy import BadImage

    data = jpeg_bytes(photo(64, 64))
    with pytest.raises(BadImage):
        decode_rgb_region(data[: len(data) // 2], 0, 0, 32, 32)


def _channels_last(images: torch.Tensor) -> bool:
    return images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()


@pytest.mark.parametrize("hw", [(260, 300), (900, 700), (112, 112)])  # 112: a crop that needs no resize
def test_channels_last_presets_give_the_same_values_laid_out_channels_last(hw):
    data = jpeg_bytes(photo(hw[1], hw[0], seed=5))
    kw = {"scale": (1.0, 1.0), "ratio": (1.0, 1.0)} if hw == (112, 112) else {}
    planar, cl = TrainTransform(112, **kw), TrainTransform(112, channels_last=True, **kw)
    for seed in range(12):
        a = planar.from_bytes(data, torch.Generator().manual_seed(seed))
        b = cl.from_bytes(data, torch.Generator().manual_seed(seed))
        assert torch.equal(a, b)
        assert a.is_contiguous(), a.stride()  # the default layout never depends on the image
        assert _channels_last(b[None]), b.stride()
    img = photo(hw[1], hw[0], seed=6)
    for planar, cl in ((EvalTransform(96, 112), EvalTransform(96, 112, channels_last=True)),
                       (EvalTransform(112, 112), EvalTransform(112, 112, channels_last=True))):
        for a, b in ((planar.from_bytes(data), cl.from_bytes(data)), (planar(img), cl(img))):
            assert torch.equal(a, b)
            assert b.stride(0) == 1 and b.stride(2) == 3  # a center crop of a channels-last image
            assert collate_uint8([(a, 0)])[0].is_contiguous() and _channels_last(collate_uint8([(b, 0)])[0])
    assert "channels_last=True" in repr(cl) and "channels_last" not in repr(planar)


@pytest.mark.parametrize("hw", [(260, 300), (900, 700), (112, 112)])  # 112: a crop that needs no resize
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("channels_last", [False, True])
def test_train_from_bytes_into_a_batch_slot_gives_the_same_image(hw, layout, channels_last):
    data = jpeg_bytes(photo(hw[1], hw[0], seed=5))
    kw = {"scale": (1.0, 1.0), "ratio": (1.0, 1.0)} if hw == (112, 112) else {}
    t = TrainTransform(112, channels_last=channels_last, **kw)
    batch = torch.full((4, 3, 112, 112), 7, dtype=torch.uint8).contiguous(memory_format=layout)
    flips = set()
    for seed in range(16):
        ref = t.from_bytes(data, torch.Generator().manual_seed(seed))
        slot = batch[seed % 4]
        got = t.from_bytes(data, torch.Generator().manual_seed(seed), out=slot)
        flipped = t.draw(data, torch.Generator().manual_seed(seed))[6]
        flips.add(flipped)
        assert torch.equal(got, ref)
        # unflipped: written into the slot, in the slot's layout; flipped: a new image for the caller to copy
        assert (got.data_ptr() == slot.data_ptr() and got.stride() == slot.stride()) is not flipped
        if not flipped:
            assert torch.equal(slot, ref)
    assert flips == {False, True}


@pytest.mark.parametrize("hw", [(300, 320), (260, 300), (900, 700)])
def test_channels_last_presets_take_a_planar_tensor_too(hw):
    # a CHW tensor laid out planar (torchvision.io.decode_jpeg's) met torch's uint8 kernel with a channels-last
    # output, which it refuses with an internal assert ("num_channels == unpacked_output.size(0)"): the input
    # is now made channels-last first; the same values as from the HWC view of the same pixels
    hwc = torch.from_numpy(np.array(photo(hw[1], hw[0], seed=7)))
    planar, view = hwc.permute(2, 0, 1).contiguous(), hwc.permute(2, 0, 1)
    for cl in (False, True):
        ev = EvalTransform(96, 112, channels_last=cl)
        a, b = ev(planar), ev(view)
        assert torch.equal(a, b)
        if cl:
            assert a.stride(0) == 1 and a.stride(2) == 3  # a center crop of a channels-last image
        tr = TrainTransform(112, channels_last=cl)
        for seed in range(6):
            torch.manual_seed(seed)
            a = tr(planar)
            torch.manual_seed(seed)
            assert torch.equal(a, tr(view))
            assert _channels_last(a[None]) if cl else a.is_contiguous(), a.stride()


def test_collate_uint8_keeps_a_channels_last_layout_only_when_every_sample_has_it():
    hwc = [torch.randint(0, 256, (5, 7, 3), dtype=torch.uint8) for _ in range(4)]
    cl = [(x.permute(2, 0, 1), i) for i, x in enumerate(hwc)]
    planar = [(x.permute(2, 0, 1).contiguous(), i) for i, x in enumerate(hwc)]
    a, la = collate_uint8(planar)
    b, lb = collate_uint8(cl)
    assert a.is_contiguous() and _channels_last(b) and torch.equal(a, b) and torch.equal(la, lb)
    mixed, _ = collate_uint8(cl[:2] + planar[2:])
    assert mixed.is_contiguous() and torch.equal(mixed, a)
