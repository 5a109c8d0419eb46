"""The API page's parameter tables come from Google-style ``Args:`` sections (mkdocstrings, griffe): an entry
that names two parameters at once (``cache_dir, cache_limit:``) matches no parameter, so the page showed it
without a default, as if required (issue 34). Each entry must name one parameter of the signature."""

from __future__ import annotations

import inspect

import griffe
import pytest

import fastload


@pytest.mark.parametrize("name", ["LMDBImageDataset"])
def test_each_documented_argument_is_one_parameter_of_the_signature(name):
    obj = getattr(fastload, name)
    sections = griffe.Docstring(inspect.getdoc(obj), lineno=1).parse("google")
    documented = [p.name for s in sections if s.kind.value == "parameters" for p in s.value]
    params = set(inspect.signature(obj).parameters)
    assert documented and [n for n in documented if n not in params] == []
