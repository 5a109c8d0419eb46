"""The rooms against the imports: docs/layout.md is the single description of the rooms.

Every module under ``fastload/`` is listed in docs/layout.md, and every import of a fastload
module (at module level or inside a function) goes to a room on a lower floor of that page,
or stays inside its own room. Inside a room the modules import each other in no circle, and a
``_private`` module is imported only inside its own room.
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


def module_of(target: str, known: set[str]) -> str:
    """The module an imported name lives in (``fastload.store.reader.release`` -> ``fastload.store.reader``)."""
    while target not in known and "." in target:
        target = target.rpartition(".")[0]
    return target


def in_room_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {module of the same room it imports: line}, the room's face (``__init__``) left out: it
    re-exports its room, and the room's modules may import names through it only by its own rules."""
    paths = modules(root)
    known = {module_name(p, root) for p in paths}
    graph: dict[str, dict[str, int]] = {}
    for path in paths:
        here = module_name(path, root)
        if path.name == "__init__.py":
            continue
        for line, target in imported(path, root):
            there = module_of(target, known)
            if there != here and there in known and room_of(there) == room_of(here) and there.count(".") >= 2 \
                    and not there.endswith(".__init__") and there.split(".")[-1] != room_of(here):
                graph.setdefault(here, {}).setdefault(there, line)
    return graph


def circles(root: Path = ROOT) -> list[str]:
    """Every circle of imports inside a room, one line each (``a -> b -> a``), whatever its length."""
    graph = in_room_graph(root)
    found: set[tuple[str, ...]] = set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in graph.get(node, {}):
            if nxt == path[0]:
                i = path.index(min(path))
                found.add(tuple(path[i:] + path[:i]))
            elif nxt not in path and nxt > path[0]:
                walk(nxt, path + [nxt])

    for start in graph:
        walk(start, [start])
    return [" -> ".join(c + (c[0],)) for c in sorted(found)]


def private_imports(root: Path = ROOT) -> list[str]:
    """Imports of another room's ``_private`` module (a module whose own name starts with ``_``)."""
    paths = modules(root)
    known = {module_name(p, root) for p in paths}
    broken = []
    for path in paths:
        here = module_name(path, root)
        for line, target in imported(path, root):
            there = module_of(target, known)
            last = there.split(".")[-1]
            if last.startswith("_") and not last.startswith("__") and room_of(there) != room_of(here):
                broken.append(f"{path.relative_to(root)}:{line} imports {there}, private to {room_of(there)}")
    return sorted(set(broken))


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


def test_no_room_imports_itself_in_a_circle():
    found = circles()
    assert not found, ("modules of one room that import each other in a circle (move the shared piece down "
                       "instead of hiding the circle in a deferred import):\n" + "\n".join(found))


def test_no_room_imports_another_rooms_private_module():
    broken = private_imports()
    assert not broken, "a _module is imported only inside its own room:\n" + "\n".join(broken)


def _tree(tmp_path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "fastload" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize("files, expected", [
    ({"store/a.py": "from fastload.store.b import x\n", "store/b.py": "def f():\n    from fastload.store.a import y\n"},
     ["fastload.store.a -> fastload.store.b -> fastload.store.a"]),  # one side hidden in a function
    ({"pack/a.py": "from .b import x\n", "pack/b.py": "from . import c\n", "pack/c.py": "import fastload.pack.a\n"},
     ["fastload.pack.a -> fastload.pack.b -> fastload.pack.c -> fastload.pack.a"]),  # three long, relative
    ({"load/a.py": "from fastload.load.b import x\n", "load/b.py": "from fastload.load.c import y\n",
      "load/c.py": "import os\n"}, []),  # a chain down, no circle
    ({"load/a.py": "from fastload.load import b\n", "load/b.py": "from fastload.store.a import z\n",
      "store/a.py": "from fastload.errors import E\n"}, []),  # a room's face is not a module of the circle
])
def test_a_circle_inside_a_room_is_reported_at_any_length(tmp_path, files, expected):
    assert circles(_tree(tmp_path, files)) == expected


@pytest.mark.parametrize("files, bad", [
    ({"cli/x.py": "from fastload.profiling._probe import f\n", "profiling/_probe.py": ""}, True),
    ({"pack/x.py": "def f():\n    from fastload._helpers import g\n", "_helpers.py": ""}, True),  # an edge module
    ({"profiling/x.py": "from fastload.profiling._probe import f\n", "profiling/_probe.py": ""}, False),  # own room
    ({"cli/x.py": "from fastload.profiling.compare import f\n", "profiling/compare.py": ""}, False),
])
def test_an_import_of_another_rooms_private_module_is_reported(tmp_path, files, bad):
    assert bool(private_imports(_tree(tmp_path, files))) == bad


def test_the_default_image_size_is_named_once():
    """224 (and eval's 256) as a default is written in one place, ``fastload.image.DEFAULT_SIZE``: a default
    written as a literal elsewhere would stay behind when that one changes."""
    literal = re.compile(r"\b(?:size|resize|image_size)\s*:\s*int\s*=\s*(?:224|256)\b|default=224\b|"
                         r"Transform\(224")
    found = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "fastload").rglob("*.py"))
             if path != ROOT / "fastload" / "image" / "__init__.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if literal.search(line)]
    assert found == []


def test_the_named_default_size_reaches_presets_pipelines_and_commands():
    from click.testing import CliRunner

    from fastload.cli import main
    from fastload.image import DEFAULT_RESIZE, DEFAULT_SIZE
    from fastload.load.transforms import EvalTransform, TrainTransform

    assert TrainTransform().size == DEFAULT_SIZE and EvalTransform().resize == DEFAULT_RESIZE
    help_text = " ".join(CliRunner().invoke(main, ["convert", "--help"]).output.split())
    assert f"is for. [default: {DEFAULT_SIZE}; x>=8]" in help_text
