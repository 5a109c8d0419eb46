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
