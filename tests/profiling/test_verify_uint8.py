"""``--verify-fix`` with the uint8 presets on a torchvision ImageFolder: the translation of the user's
transform chain, the batches the unmodified loop then gets (same dtype, shape, normalisation, labels),
the refusal of chains the presets do not reproduce (naming the transform), the prediction for what
was applied, and the CLI end to end on a tiny JPEG tree made in tmp_path.

Tolerance of the pixel comparisons, in levels of 255 per pixel: a mean of 0.5 and a maximum of 8. The
same file decoded by Pillow (torchvision's loader) and by simplejpeg (the preset), both libjpeg-turbo,
can differ by a level; Pillow's bilinear resize and torch's antialiased uint8 resize round
differently; the 96x128 image is decoded at 1/2 scale (DCT) by the eval preset, and a train crop
that needs less than the full image is decoded at a DCT scale with its box rounded outwards. Measured
on the smooth images made here (16:55 UTC): eval chains mean 0.05, max 2 levels; train chains mean
0.08-0.12, max 3-4 levels. A wrong mean/std, channel order, crop box or flip moves the mean by tens
of levels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fastload.profiling import _uint8
from fastload.profiling._recommend import change_to_verify, recommend, verify_prediction

T = pytest.importorskip("torchvision.transforms")
v2 = pytest.importorskip("torchvision.transforms.v2")
from torchvision.datasets import ImageFolder  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
MEAN_LEVELS, MAX_LEVELS = 0.5, 8  #: see the module doc


def make_tree(root: Path, sizes=((48, 64), (60, 44), (52, 52), (96, 128), (40, 72), (64, 48))) -> Path:
    """Two classes of smooth RGB gradients (JPEG, quality 95) and one PNG, sizes (height, width)."""
    rng = np.random.default_rng(3)
    for n, (h, w) in enumerate(sizes):
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        a, b, c = rng.uniform(0.5, 2.0, 3)
        img = np.stack([127 + 100 * np.sin(a * x / w * 3), 127 + 100 * np.cos(b * y / h * 3),
                        127 + 100 * np.sin(c * (x + y) / (w + h) * 3)], axis=2).astype(np.uint8)
        folder = root / f"class{n % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(folder / f"{n}.jpg", quality=95)
    Image.fromarray(np.full((50, 70, 3), (30, 140, 220), np.uint8)).save(root / "class1" / "flat.png")
    return root


def first_batch(dataset, *, seed: int = 0, swap: bool = False):
    loader = torch.utils.data.DataLoader(dataset, batch_size=7, num_workers=0)
    wrap = None
    if swap:
        info, wrap = _uint8.apply(loader)
        assert info["normalise"] == "main process"
    torch.manual_seed(seed)
    it = iter(loader)
    return next(wrap(it) if wrap else it)


def assert_same_batches(ours, theirs, std):
    assert isinstance(ours, list) and len(ours) == 2  # default_collate gives (image, label) samples as a list
    (a, y), (b, z) = ours, theirs
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
    assert y.dtype == z.dtype == torch.int64 and torch.equal(y, z)
    levels = (a - b).abs() * torch.tensor(std).view(1, 3, 1, 1) * 255  # back to 0..255 levels per channel
    assert levels.mean() < MEAN_LEVELS and levels.max() < MAX_LEVELS, (levels.mean(), levels.max())


EVAL = {
    "ToTensor+Normalize": (lambda: T.Compose([T.Resize(36), T.CenterCrop(32), T.ToTensor(), T.Normalize(MEAN, STD)]),
                           STD),
    "PILToTensor+ConvertImageDtype": (lambda: T.Compose([T.Resize([36]), T.CenterCrop((32, 32)), T.PILToTensor(),
                                                         T.ConvertImageDtype(torch.float32)]), (1.0, 1.0, 1.0)),
    "v2 ToImage+ToDtype+Normalize": (lambda: v2.Compose([v2.ToImage(), v2.Resize(36), v2.CenterCrop(32),
                                                         v2.ToDtype(torch.float32, scale=True),
                                                         v2.Normalize(MEAN, STD)]), STD),
}


@pytest.mark.parametrize("chain", list(EVAL))
def test_eval_chain_translated_gives_the_loop_the_same_batches(tmp_path, chain):
    make, std = EVAL[chain]
    ds = ImageFolder(str(make_tree(tmp_path / "tree")), transform=make())
    theirs = first_batch(ds)
    transform, loader_fn = ds.transform, ds.loader
    ours = first_batch(ds, swap=True)
    assert_same_batches(ours, theirs, std)
    assert ds.transform is transform and ds.loader is loader_fn  # a copy was swapped in, not the user's dataset
    assert repr(_uint8.translate(ds.transform).preset) == "EvalTransform(size=32, resize=36)"


TRAIN = {
    "v1": lambda: T.Compose([T.RandomResizedCrop(32, scale=(0.3, 1.0)), T.RandomHorizontalFlip(), T.ToTensor(),
                             T.Normalize(MEAN, STD)]),
    "v2": lambda: v2.Compose([v2.ToImage(), v2.RandomResizedCrop(32, scale=(0.3, 1.0)), v2.RandomHorizontalFlip(),
                              v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]),
}


@pytest.mark.parametrize("chain", list(TRAIN))
def test_train_chain_draws_the_same_crops_and_flips_under_the_same_seed(tmp_path, chain):
    ds = ImageFolder(str(make_tree(tmp_path / "tree")), transform=TRAIN[chain]())
    for seed in (0, 1):
        assert_same_batches(first_batch(ds, seed=seed, swap=True), first_batch(ds, seed=seed), STD)
    t = _uint8.translate(ds.transform)
    assert (t.mean, t.std) == (MEAN, STD)
    assert repr(t.preset) == f"TrainTransform(size=32, scale=(0.3, 1.0), ratio={(3 / 4, 4 / 3)}, flip_p=0.5)"


@pytest.mark.parametrize("transform,named", [
    (lambda: T.Compose([T.RandomResizedCrop(32), T.ColorJitter(0.4), T.ToTensor()]), "ColorJitter"),
    (lambda: T.Compose([T.Resize((32, 32)), T.ToTensor()]), "Resize"),
    (lambda: T.Compose([T.RandomResizedCrop(32, interpolation=T.InterpolationMode.BICUBIC), T.ToTensor()]),
     "(?i)bicubic"),
    (lambda: T.Compose([T.RandomResizedCrop(32), T.ToTensor(), T.Lambda(lambda x: x * 2)]), "Lambda"),
    (lambda: T.Compose([T.RandomResizedCrop(32), T.PILToTensor()]), "not float"),
    (lambda: T.Compose([T.Resize(36), T.CenterCrop(32), T.ToTensor(), T.Normalize(MEAN, STD),
                        T.RandomErasing()]), "RandomErasing"),
])
def test_a_chain_the_presets_do_not_reproduce_is_refused_by_name(transform, named):
    with pytest.raises(_uint8.NotTranslatable, match=named):
        _uint8.translate(transform())


def test_the_loader_and_dataset_must_be_the_ones_the_presets_replace(tmp_path):
    tree = make_tree(tmp_path / "tree")
    eval_chain = EVAL["ToTensor+Normalize"][0]
    own = torch.utils.data.DataLoader(ImageFolder(str(tree), transform=eval_chain()), batch_size=2,
                                      collate_fn=lambda b: b)
    with pytest.raises(_uint8.NotTranslatable, match="collate_fn '<lambda>'"):
        _uint8.apply(own)
    with pytest.raises(_uint8.NotTranslatable, match="target_transform"):
        _uint8.swap_dataset(ImageFolder(str(tree), transform=eval_chain(), target_transform=lambda y: y + 1))
    with pytest.raises(_uint8.NotTranslatable, match=r"dataset is builtins.list, not a torchvision ImageFolder"):
        _uint8.swap_dataset([1, 2])
    # a Subset of an ImageFolder (a train/val split) is swapped inside; the user's Subset is left as it was
    full = ImageFolder(str(tree), transform=eval_chain())
    subset = torch.utils.data.Subset(full, [0, 2, 4])
    swapped, _ = _uint8.swap_dataset(subset)
    assert swapped.indices == [0, 2, 4] and swapped.dataset is not full and subset.dataset is full
    assert swapped[1][0].dtype == torch.uint8 and swapped[1][0].shape == (3, 32, 32)


# -- the prediction for what was applied ---------------------------------------------------------------------


def _summary(*, workers: int, floats: float, per_sample_ms: float = 6.25,
             dataset: str = "torchvision.datasets.folder.ImageFolder") -> dict:
    step = 0.1
    return {"data_wait_fraction": 0.5, "gpu_idle_fraction": 0.5, "input_bound_idle_fraction": 0.5,
            "idle_source": "host-clock", "steps_per_s": 1 / step, "images_per_step": 8,
            "step_cpu": {"cores": 0.05},
            "loader": {"num_workers": workers, "cpus_per_process": 2, "pinned": None, "created_at": None,
                       "worker_cpu_util_mean": 0.9 if workers else None, "dataset": dataset},
            "samples": {"per_sample_ms": per_sample_ms, "cpu_share": 1.0, "runqueue_share": 0.0, "blocked_share": 0.0,
                        "float_transform_share": floats,
                        "parts": {"read": 0.0, "decode": 0.1, "transform": floats, "other": 0.9 - floats}}}


def test_without_cuda_the_prediction_moves_the_normalising_into_the_training_process():
    # 0 workers: ToTensor/Normalize move from __getitem__ to after the batch, in the same process: 1.0x, not
    # the gain of removing them (which the device variant predicts)
    s = _summary(workers=0, floats=0.6)
    _, recs = recommend(s, plan_workers=2, has_gpu=False)
    assert s["uint8_presets"]["main process"] == pytest.approx(1.0, abs=0.01) and s["uint8_presets"]["device"] is None
    assert not [r for r in recs if r["stage"] == "fast"]  # no gain predicted: not offered
    pick = change_to_verify({**s, "recommendations": recs}, "uint8_presets")
    assert pick["apply"] == {"uint8_presets": True} and "not recommended" in pick["verify_why"]
    assert verify_prediction(pick, {"uint8_presets": {"normalise": "main process"}})[0] == pytest.approx(1.0, abs=0.01)
    assert not pick.get("bound")
    # loader threads: no thread model, so the figure checked is an upper bound ("up to"), not a prediction
    s = _summary(workers=2, floats=0.6)
    s["loader"]["backend"] = "threads"
    _, recs = recommend(s, plan_workers=2, has_gpu=False)
    assert change_to_verify({**s, "recommendations": recs}, "uint8_presets")["bound"]
    # 2 workers that deliver a batch (8 x 25 ms) every 100 ms, the measured step: the float work leaves 2
    # parallel workers for the one training process, 120 ms of it per step there: slower
    s = _summary(workers=2, floats=0.6, per_sample_ms=25.0)
    recommend(s, plan_workers=2, has_gpu=False)
    assert s["uint8_presets"]["main process"] < 0.9


def test_on_a_gpu_the_verified_prediction_is_for_the_change_alone_where_it_normalised():
    s = _summary(workers=0, floats=0.6)
    _, recs = recommend(s, plan_workers=2, has_gpu=True)
    fast = next(r for r in recs if r["stage"] == "fast")
    assert fast["apply"] == {"uint8_presets": True}
    on_device = verify_prediction(fast, {"uint8_presets": {"normalise": "cuda:0"}})
    on_host = verify_prediction(fast, {"uint8_presets": {"normalise": "main process"}})
    # one prediction per run: the recommendation's own figure is the presets alone at today's worker count, the
    # one verify-fix checks on the device; the training-process variant (this script used no CUDA) is said too
    assert 1.2 < on_device[0] == fast["expected_gain"] and on_host[0] == pytest.approx(1.0, abs=0.01)
    assert f"predicted {on_host[0]:.2f}x for that" in fast["why"] and "training process" in fast["verify_part"]
    assert "training process" in on_host[1] and "cuda:0" in on_device[1]
    # a dataset --verify-fix cannot swap: the recommendation stays, without an apply
    s = _summary(workers=0, floats=0.6, dataset="fastload.load.dataset.LMDBImageDataset")
    _, recs = recommend(s, plan_workers=2, has_gpu=True)
    assert "apply" not in next(r for r in recs if r["stage"] == "fast")


def test_the_cli_choices_are_what_the_probe_can_apply():
    from fastload.cli.profiling import profile
    from fastload.profiling._probe import APPLICABLE

    option = next(p for p in profile.params if p.name == "verify_change")
    assert tuple(option.type.choices) == APPLICABLE


# -- end to end: fastload profile --verify-fix -- python train.py ---------------------------------------------

SCRIPT = '''
import os, sys, time
import torch
from torchvision import datasets, transforms as T

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
chain = [T.Resize(36), T.CenterCrop(32)]
if os.environ.get("JITTER"):
    chain.append(T.ColorJitter(0.3))
ds = datasets.ImageFolder(os.environ["DATA"], transform=T.Compose(chain + [T.ToTensor(), T.Normalize(MEAN, STD)]))
loader = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True, drop_last=True,
                                     num_workers=int(os.environ.get("WORKERS", "0")))
for epoch in range(100):
    for images, labels in loader:
        # the contract the script was written for: a change that broke it fails the run
        if images.dtype != torch.float32 or images.shape != (4, 3, 32, 32) or labels.dtype != torch.int64:
            sys.exit(f"batch contract broken: {images.dtype} {tuple(images.shape)} {labels.dtype}")
        low = ((0 - torch.tensor(MEAN)) / torch.tensor(STD)).view(1, 3, 1, 1)
        high = ((1 - torch.tensor(MEAN)) / torch.tensor(STD)).view(1, 3, 1, 1)
        if (images < low - 1e-4).any() or (images > high + 1e-4).any():
            sys.exit("batch contract broken: not normalised with the script's mean/std")
        time.sleep(0.002)
'''


def run_cli(tmp_path: Path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    data = make_tree(tmp_path / "tree")
    full = dict(os.environ, PYTHONPATH=str(REPO), DATA=str(data), **env)
    full.pop("FASTLOAD_PROFILE_OUT", None)
    return subprocess.run([sys.executable, "-m", "fastload.cli", "profile", *args, "--", sys.executable, str(script)],
                          env=full, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_verify_fix_names_the_transform_it_cannot_translate(tmp_path):
    out = tmp_path / "out"
    proc = run_cli(tmp_path, ["--steps", "8", "--warmup", "2", "--out", str(out), "--verify-change", "uint8_presets"],
                   JITTER="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    v = json.loads((out / "profile.json").read_text())["verify_fix"]
    assert v["apply"] == {"uint8_presets": True} and v["applied"] == {} and v["measured"] is None
    line = next(x for x in proc.stdout.splitlines() if x.startswith("verify-fix:"))
    assert "NOT APPLIED" in line and "ColorJitter" in line and "uint8_presets" in line
    assert not (out / "verify" / "round2-baseline").exists()


@pytest.mark.slow
def test_verify_fix_applies_the_uint8_presets_and_the_loop_keeps_its_batches(tmp_path):
    out = tmp_path / "out"
    proc = run_cli(tmp_path, ["--steps", "12", "--warmup", "2", "--out", str(out), "--verify-change", "uint8_presets"])
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the script exits non-zero on a broken batch
    summary = json.loads((out / "profile.json").read_text())
    v = summary["verify_fix"]
    applied = v["applied"]["uint8_presets"]
    assert applied["transform"] == "EvalTransform(size=32, resize=36)" and applied["normalise"] == "main process"
    assert applied["mean"] == list(MEAN) and applied["std"] == list(STD)
    # no CUDA: the prediction is the main-process variant (0 workers: the same work in the same process)
    assert v["predicted"] == pytest.approx(summary["uint8_presets"]["main process"])
    assert v["measured"] > 0 and len(v["round_ratios"]) == 2 and "training process" in v["assumption"]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("verify-fix:"))
    assert "applied {'uint8_presets': {" in line and "predicted" in line and "measured" in line
    assert "  predicted with: normalised in the training process" in proc.stdout
    changed = json.loads((out / "verify" / "profile.json").read_text())
    assert changed["samples"]["float_transform_share"] == 0.0  # ToTensor/Normalize no longer in the samples
    assert "EvalTransform" in changed["samples"]["transforms"]


@pytest.mark.gpu
def test_on_cuda_the_batches_are_converted_on_the_device(tmp_path):
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the process uses CUDA, as a training script has by its first batch
    ds = ImageFolder(str(make_tree(tmp_path / "tree")), transform=EVAL["ToTensor+Normalize"][0]())
    theirs = first_batch(ds)
    loader = torch.utils.data.DataLoader(ds, batch_size=7, num_workers=0)
    info, wrap = _uint8.apply(loader)
    assert info["normalise"].startswith("cuda")
    images, labels = next(wrap(iter(loader)))
    assert images.device.type == "cuda" and labels.device.type == "cuda"
    assert_same_batches([images.cpu(), labels.cpu()], theirs, STD)
