"""The README's quick start and "three lines" run, doctest-style, on tiny generated data.

Every fenced block of those two sections is read from README.md itself, so the front page
cannot drift from the code. What cannot run here is checked instead, and says so:
creating a venv and ``pip install`` need the network (the test checks that the pins and
extras they name are the project's), and ``python -m pytest`` cannot run the whole suite
from inside it (the test runs the same command on one small test file). The recipe runs as
written with overrides that make it small (``--folder`` a tiny generated tree, few steps,
no DALI stages); the Python snippets run in order in one namespace, with the store path
pointed at a tiny store and ``"cuda"`` at the CPU when there is no GPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def blocks(title: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block in the README section ``## {title}``."""
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    text = README[start:end if end != -1 else None]
    return re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S)


def test_the_quick_start_is_two_commands_each_on_readable_lines():
    found = blocks("Quick start")
    assert [lang for lang, _ in found] == ["bash", "bash"]
    setup, tests = (code.strip().splitlines() for _, code in found)
    assert setup[-1] == "fastload recipe run recipes/quickstart.toml"
    assert tests == ["python -m pytest"]
    assert all(len(line) <= 100 and "&&" not in line for line in setup)


def test_the_setup_lines_name_the_projects_pins_and_extras():
    """The venv and pip lines need the network: check what they install is what CI installs."""
    setup = blocks("Quick start")[0][1].strip().splitlines()
    assert setup[0] == "python3 -m venv .venv" and setup[1] == ". .venv/bin/activate"
    pins = [line for line in setup if line.startswith("pip install torch")]
    ci = (ROOT / ".ci" / "run").read_text()
    assert len(pins) == 1
    assert all(pin in ci.split() for pin in pins[0].split() if "==" in pin), pins[0]
    editable = [line for line in setup if line.startswith("pip install -e")]
    assert len(editable) == 1
    extras = re.search(r'"\.\[([\w,]+)\]"', editable[0]).group(1).split(",")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras) <= set(declared), set(extras) - set(declared)


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A tiny generated ImageFolder tree and its store; FASTLOAD_CACHE inside tmp_path."""
    import fastload
    from fastload.datasets import DatasetSpec

    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "cache"))
    tree = fastload.make_dataset(tmp_path / "tree", DatasetSpec(num_classes=2, per_class=6, min_side=32,
                                                                max_side=64, png_every=0))
    store = tmp_path / "tiny.lmdb"
    fastload.convert(tree, store, fastload.ConvertOptions(progress=False))
    return tree, store


def test_the_quick_start_recipe_runs_on_tiny_data(tiny, tmp_path):
    tree, _ = tiny
    command = blocks("Quick start")[0][1].strip().splitlines()[-1].split()
    assert command[0] == "fastload"
    small = ["--folder", str(tree), "--steps", "2", "--warmup", "1", "--rounds", "1", "--batch-size", "4",
             "--image-size", "32", "--step-ms", "1", "--stage", "baseline", "--stage", "fast",
             "--out", str(tmp_path / "out"), "--quiet"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "fastload.cli", *command[1:], *small], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verdict:" in proc.stdout
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [s["name"] for s in results["stages"]] == ["baseline", "fast"]


def test_the_test_command_runs_in_this_checkout():
    """``python -m pytest`` as the README writes it, on one small file (the whole suite cannot nest)."""
    command = blocks("Quick start")[1][1].strip().split()
    assert command == ["python", "-m", "pytest"]
    proc = subprocess.run([sys.executable, *command[1:], "-q", "-p", "no:cacheprovider", "tests/test_layout.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_the_three_lines_and_the_resume_snippets_run(tiny, tmp_path, monkeypatch):
    _, store = tiny
    found = blocks("Three lines in your training script")
    assert found and all(lang == "python" for lang, _ in found)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.chdir(tmp_path)  # the snippets write ckpt.pt where they run
    model = torch.nn.Linear(1, 1)
    namespace = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
    for _, code in found:
        code = code.replace("/fast/imagenet-train.lmdb", str(store)).replace('"cuda"', f'"{device}"')
        exec(compile(code, "README.md", "exec"), namespace)
    images, labels = namespace["images"], namespace["labels"]
    assert images.dtype in (torch.float32, torch.bfloat16) and images.ndim == 4 and images.shape[1] == 3
    assert labels.dtype == torch.int64 and images.device.type == device
    assert (tmp_path / "ckpt.pt").exists()
    assert namespace["loader"].state_dict()  # the loader the snippets built, resumed from the file
