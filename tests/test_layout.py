"""The rooms against the imports: docs/layout.md is the single description of the rooms.

Every module under ``fastload/`` is listed in docs/layout.md, and every import of a fastload
module (at module level or inside a function) goes to a room on a lower floor of that page,
or stays inside its own room.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = ROOT / "docs" / "layout.md"


def floors(text: str) -> dict[str, int]:
    """Room -> floor, from the numbered list under "## Floors" (``image/`` is ``image``, ``errors.py`` ``errors``)."""
    section = text.split("## Floors", 1)[1].split("\n## ", 1)[0]
    rooms: dict[str, int] = {}
    for line in section.splitlines():
        m = re.match(r"(\d+)\. ", line)
        if m:
            for name in re.findall(r"`([\w.]+/?)`", line):
                rooms[name.removesuffix("/").removesuffix(".py")] = int(m.group(1))
    return rooms


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) for every fastload module this file imports, relative imports resolved."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.startswith("fastload.")]
    return found


def modules(root: Path = ROOT) -> list[Path]:
    return sorted((root / "fastload").rglob("*.py"))


def violations(rooms: dict[str, int], root: Path = ROOT) -> list[str]:
    broken = []
    for path in modules(root):
        here = room_of(module_name(path, root))
        for line, target in imported(path, root):
            there = room_of(target)
            if there != here and not rooms[there] < rooms[here]:
                broken.append(f"{path.relative_to(root)}:{line} ({here}, floor {rooms[here]}) imports {target} "
                              f"({there}, floor {rooms[there]})")
    return broken


def test_the_layout_page_lists_every_module_and_places_every_room():
    text = LAYOUT.read_text()
    missing = [str(p.relative_to(ROOT)) for p in modules() if f"`{p.relative_to(ROOT).as_posix()}`" not in text]
    assert not missing, f"docs/layout.md does not list {missing}; add each with what it owns"
    rooms = floors(text)
    unplaced = sorted({room_of(module_name(p)) for p in modules()} - set(rooms))
    assert not unplaced, f"docs/layout.md places no floor for the rooms {unplaced}"


def test_no_import_runs_back_up_or_across_a_floor():
    broken = violations(floors(LAYOUT.read_text()))
    assert not broken, "imports that do not run down the floors of docs/layout.md:\n" + "\n".join(broken)


@pytest.mark.parametrize("source, expected", [
    ("from fastload.measure import env\n", ["fastload.measure", "fastload.measure.env"]),
    ("def f():\n    from ..measure.env import environment\n",
     ["fastload.measure.env", "fastload.measure.env.environment"]),
    ("import fastload.bench.loader as b\n", ["fastload.bench.loader"]),
])
def test_imports_are_found_at_any_depth_and_relative(tmp_path, source, expected):
    path = tmp_path / "fastload" / "profiling" / "mod.py"
    path.parent.mkdir(parents=True)
    path.write_text(source)
    assert [m for _, m in imported(path, tmp_path)] == expected


@pytest.mark.parametrize("room, source, bad", [
    ("measure", "def f():\n    from fastload.bench.loader import bench_loader\n", True),  # back up
    ("measure", "from fastload.serve import app\n", True),  # across: serve/ stands beside measure/
    ("bench", "from fastload.measure.env import environment\n", False),  # down
    ("measure", "from fastload.measure import rounds\n", False),  # inside its own room
])
def test_an_import_up_or_across_is_reported_and_one_down_is_not(tmp_path, room, source, bad):
    path = tmp_path / "fastload" / room / "mod.py"
    path.parent.mkdir(parents=True)
    path.write_text(source)
    assert bool(violations(floors(LAYOUT.read_text()), tmp_path)) == bad
