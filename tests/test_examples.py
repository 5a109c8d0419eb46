"""The examples use only fastload's public names: what a user copies must keep working."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fastload

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


def private_imports(source: str) -> list[str]:
    """Every fastload import that is not ``import fastload`` or ``from fastload import <name in __all__>``."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.startswith("fastload.")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fastload":
            if node.module == "fastload.dali":  # the DALI face is public: fastload/dali.py
                continue
            if node.module != "fastload":
                bad.append(node.module)
            else:
                bad += [f"fastload.{a.name}" for a in node.names if a.name not in fastload.__all__]
    return bad


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_import_only_public_names(path):
    assert not private_imports(path.read_text()), f"{path.name} imports private fastload names"


@pytest.mark.parametrize("source, bad", [
    ("from fastload.load.prefetch import prepare_batch\n", ["fastload.load.prefetch"]),
    ("import fastload.load.loader\n", ["fastload.load.loader"]),
    ("from fastload import DataLoader, _EXPORTS\n", ["fastload._EXPORTS"]),
    ("import fastload\nfrom fastload import prepare_batch\nfrom fastload.dali import DALILoader\n", []),
])
def test_the_check_tells_private_from_public(source, bad):
    assert private_imports(source) == bad
