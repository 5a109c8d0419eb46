"""The public surface: everything in __all__ resolves, and `import fastload` stays light."""

from __future__ import annotations

import subprocess
import sys

import fastload


def test_every_public_name_resolves():
    for name in fastload.__all__:
        assert getattr(fastload, name) is not None, name


def test_public_modules_export_what_they_define():
    import importlib

    for module in set(fastload._EXPORTS.values()):
        mod = importlib.import_module(module)
        for name, target in fastload._EXPORTS.items():
            if target == module:
                assert name in mod.__all__, f"{name} missing from {module}.__all__"


def test_import_is_light():
    code = "import sys, fastload; print(sorted(m for m in ('torch', 'nvidia.dali', 'matplotlib') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_all_is_exactly_the_public_names_both_ways():
    """As httpx's tests/test_exported_members.py: every name ``fastload`` holds without a leading underscore
    is in ``__all__`` and every ``__all__`` name is held once touched; no import helper (``importlib``, ``Any``,
    ``annotations``) leaks into the surface. Rooms a touched name imported (``fastload.load``...) are
    submodules, not names of the surface; ``fastload.dali`` and ``fastload.serve`` are the two public faces."""
    code = ("import types, fastload\n"
            "before = sorted(n for n in vars(fastload) if not n.startswith('_'))\n"
            "[getattr(fastload, n) for n in fastload.__all__]\n"
            "after = sorted(n for n, v in vars(fastload).items() if not n.startswith('_')\n"
            "               and not isinstance(v, types.ModuleType))\n"
            "print(before, after, sorted(n for n in dir(fastload) if not n.startswith('_')), sep='\\n')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    public = sorted(n for n in fastload.__all__ if not n.startswith("_"))
    assert out[0] == "[]"  # nothing but dunders before a name is touched
    assert out[1] == repr(public) and out[2] == repr(public)
    assert fastload.__all__ == sorted(public) + ["__version__"]
