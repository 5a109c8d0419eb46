"""The documentation covers the public surface, and every page is in the navigation."""

from __future__ import annotations

import re
from pathlib import Path

import fastload

ROOT = Path(__file__).resolve().parent.parent


def test_the_api_reference_documents_every_public_name():
    documented = set(re.findall(r"^::: [\w.]+\.(\w+)$", (ROOT / "docs" / "api.md").read_text(), flags=re.M))
    missing = sorted(set(fastload.__all__) - {"__version__"} - documented)
    assert not missing, f"docs/api.md has no entry for {missing}"


def test_every_page_is_in_the_navigation_and_every_entry_has_a_page():
    """What ``mkdocs build --strict`` enforces, checked without building (CI builds too)."""
    config = (ROOT / "mkdocs.yml").read_text()
    nav = set(re.findall(r"^  - [^:#]+: ([\w-]+\.md)$", config, flags=re.M))
    pending = set(re.findall(r"^  # - [^:]+: ([\w-]+\.md)$", config, flags=re.M))  # pages of other branches
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages - pending == nav, (sorted(pages - pending - nav), sorted(nav - pages))
    assert not nav & pending
