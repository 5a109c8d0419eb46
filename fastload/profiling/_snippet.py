"""The code change of a recommendation, written against the user's own ``DataLoader(...)`` line.

Owns: finding the ``DataLoader(...)`` call the probe saw constructed (``created_at``: file and line),
and rewriting its keyword arguments (``num_workers``, ``pin_memory``) as a copy-paste snippet, with
``from fastload import DataLoader`` where the change needs fastload's loader (``num_workers="auto"``);
and the store advice's lines for the user's own folder (the ``convert`` command, the store beside it).
The call is located with :mod:`ast` and edited as text, so the user's own formatting is kept.

Must not: write to the user's files, run or import their code, import torch.
"""

from __future__ import annotations

import ast
import shlex
from pathlib import Path
from typing import Any

FASTLOAD_ONLY = {"num_workers": ("auto",)}  #: keyword values torch's own DataLoader does not accept


def _find_call(source: str, line: int) -> tuple[ast.stmt, ast.Call] | None:
    """The statement that holds the ``...DataLoader(`` call starting on ``line`` (or spanning it)."""
    tree = ast.parse(source)
    best: tuple[ast.stmt, ast.Call] | None = None
    for stmt in ast.walk(tree):
        if not isinstance(stmt, ast.stmt) or isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                              ast.ClassDef, ast.If, ast.For, ast.While,
                                                              ast.With, ast.Try)):
            continue
        for node in ast.walk(stmt):
            if (isinstance(node, ast.Call) and node.lineno <= line <= (node.end_lineno or node.lineno)
                    and ast.unparse(node.func).split(".")[-1].endswith("DataLoader")):
                best = (stmt, node)
    return best


def _offset(lines: list[str], lineno: int, col: int) -> int:
    return sum(len(x) for x in lines[:lineno - 1]) + len(lines[lineno - 1].encode()[:col].decode())


def _literal(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def loader_snippet(created_at: str | None, changes: dict[str, Any]) -> str | None:
    """``changes`` (keyword -> new value) applied to the user's ``DataLoader(...)`` statement, as text to
    paste, headed by ``# file:line`` and the import it needs; None when the line cannot be read."""
    if not created_at or ":" not in created_at:
        return None
    name, _, lineno = created_at.rpartition(":")
    try:
        source = Path(name).read_text()
        found = _find_call(source, int(lineno))
    except (OSError, ValueError, SyntaxError, UnicodeDecodeError):
        return None
    if found is None:
        return None
    stmt, call = found
    lines = source.splitlines(keepends=True)
    start = _offset(lines, stmt.lineno, stmt.col_offset)
    end = _offset(lines, stmt.end_lineno, stmt.end_col_offset)
    edits: list[tuple[int, int, str]] = []  # (start, end, text) in the file's offsets
    needs_fastload = any(changes.get(k) in v for k, v in FASTLOAD_ONLY.items())
    for key, value in changes.items():
        kw = next((k for k in call.keywords if k.arg == key), None)
        if kw is not None:
            edits.append((_offset(lines, kw.value.lineno, kw.value.col_offset),
                          _offset(lines, kw.value.end_lineno, kw.value.end_col_offset), _literal(value)))
        else:
            close = _offset(lines, call.end_lineno, call.end_col_offset) - 1  # the ")"
            edits.append((close, close, f", {key}={_literal(value)}"))
    func = ast.unparse(call.func)
    if needs_fastload and func != "DataLoader":
        edits.append((_offset(lines, call.func.lineno, call.func.col_offset),
                      _offset(lines, call.func.end_lineno, call.func.end_col_offset), "DataLoader"))
    text = source
    for a, b, new in sorted(edits, reverse=True):
        text = text[:a] + new + text[b:]
    shift = sum(len(new) - (b - a) for a, b, new in edits)
    body = text[start:end + shift]
    first = lines[stmt.lineno - 1]
    indent = first[:len(first) - len(first.lstrip())]
    head = [f"# {Path(name).name}:{stmt.lineno}"]
    if needs_fastload:
        head.append(indent + "from fastload import DataLoader  # torch's signature; num_workers=\"auto\" is fastload's")
    return "\n".join(head) + "\n" + indent + body


def store_snippet(created_at: str | None) -> str:
    where = f"  # in place of the dataset of {Path(created_at.rpartition(':')[0]).name}:" \
            f"{created_at.rpartition(':')[2]}" if created_at else ""
    return ("fastload convert IMAGE_DIR store.lmdb    # once, in a shell\n"
            "from fastload import LMDBImageDataset\n"
            f"dataset = LMDBImageDataset(\"store.lmdb\", transform=your_transform){where}")


def uint8_snippet(created_at: str | None) -> str:
    where = f"  # {Path(created_at.rpartition(':')[0]).name}:{created_at.rpartition(':')[2]}" if created_at else ""
    return ("from fastload import DataLoader, DevicePrefetcher, collate_uint8, train_transform\n"
            "dataset.transform = train_transform(224)  # uint8 CHW, no ToTensor/Normalize on the CPU\n"
            f"loader = DataLoader(dataset, batch_size=..., num_workers=\"auto\", collate_fn=collate_uint8){where}\n"
            "for images, labels in DevicePrefetcher(loader, \"cuda\"):  # normalised float on the device")


def store_path_for(root: str) -> str:
    """Where the store advice writes the user's folder's store: beside it (``<folder>.lmdb``), never inside it."""
    return str(Path(root.rstrip("/\\") or root)) + ".lmdb"


def store_presets_snippet(root: str, preset: str | None, mean: list[float] | None, std: list[float] | None,
                          created_at: str | None, *, cuda: bool) -> str:
    """The README's three lines for the user's own folder: the ``convert`` command, the store with the preset
    that reproduces their transform (``preset``: its repr, e.g. ``TrainTransform(size=224, ...)``), fastload's
    DataLoader with ``collate_uint8``, and ``DevicePrefetcher`` normalising with their mean/std, in the CUDA or
    the CPU form (``cuda``: the training process used CUDA)."""
    store = store_path_for(root)
    where = f"  # in place of {Path(created_at.rpartition(':')[0]).name}:{created_at.rpartition(':')[2]}" \
        if created_at else ""
    norm = "" if mean is None else f", mean={tuple(round(x, 4) for x in mean)}, std={tuple(round(x, 4) for x in std)}"
    # quoted for the shell: a folder with spaces or shell characters pastes as one argument
    lines = [f"fastload convert {shlex.quote(str(root))} {shlex.quote(str(store))}    "
             "# once, in a shell: the store goes beside the folder, not into it",
             "from fastload import DataLoader, DevicePrefetcher, LMDBImageDataset, collate_uint8, "
             "eval_transform, train_transform",
             f"dataset = LMDBImageDataset({_literal(store)}, transform={_preset_call(preset)}){where}",
             "loader = DataLoader(dataset, batch_size=..., shuffle=True, num_workers=\"auto\", "
             "collate_fn=collate_uint8)"]
    if cuda:
        lines.append(f"for images, labels in DevicePrefetcher(loader, \"cuda\"{norm}):  # normalised float32 on "
                     "the GPU")
        lines.append("# no CUDA on a machine: DevicePrefetcher(loader, \"cpu\", ...) normalises in the training "
                     "process (keep dtype float32 there)")
    else:
        lines.append(f"for images, labels in DevicePrefetcher(loader, \"cpu\"{norm}):  # no CUDA: normalised "
                     "float32 in this process; on a GPU machine pass \"cuda\"")
    return "\n".join(lines)


def _preset_call(preset: str | None) -> str:
    """``train_transform(...)``/``eval_transform(...)`` for a preset's repr; the default preset when unknown."""
    if not preset:
        return "train_transform(224)  # or the preset that matches your transform"
    name, _, args = preset.partition("(")
    return ("train_transform(" if name == "TrainTransform" else "eval_transform(") + args
