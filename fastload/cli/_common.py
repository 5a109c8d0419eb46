"""What every command group shares: error handling, printable names, defaults read from the
options dataclasses, and the benchmarks' common arguments and output.

Must not: import a room at module level (``fastload --help`` imports every command module and
must stay fast: no torch); hold a command.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from fastload.errors import FastloadError


def printable(text: str) -> str:
    """File names that are not valid UTF-8 (kept with surrogateescape) shown with U+FFFD, never a crash."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def friendly(fn):
    """Every fastload error becomes ``error: <message>`` and exit 1; Ctrl-C exits 130 saying how to resume."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FastloadError as exc:
            raise click.ClickException(str(exc)) from exc
        except KeyboardInterrupt:
            click.echo("\ninterrupted; everything committed so far is kept: rerun the same command to resume.",
                       err=True)
            sys.exit(130)
    return wrapper


class Default:
    """An option's default taken from a field of an options dataclass, so it is written once.

    ``Default("fastload.serve.app:ServeOptions", "max_batch")``. The module is imported only
    when the value is needed (the command runs, or its own ``--help`` shows the default):
    ``fastload --help`` imports no room. ``to_cli`` turns the field's value into the
    option's (bytes into MiB, a tuple into a comma-separated string).
    """

    def __init__(self, target: str, name: str, to_cli: Callable[[Any], Any] | None = None) -> None:
        self.target, self.name, self.to_cli = target, name, to_cli

    def value(self) -> Any:
        module, _, cls_name = self.target.partition(":")
        cls = getattr(importlib.import_module(module), cls_name)
        field = next(f for f in dataclasses.fields(cls) if f.name == self.name)
        value = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        return self.to_cli(value) if self.to_cli else value

    __call__ = value  # click calls a callable default when the command runs

    def __str__(self) -> str:  # what --help shows
        return str(self.value())

    def __bool__(self) -> bool:  # click tests a flag's default for truth in --help
        return bool(self.value())


def data_or_default(data: Path | None) -> Path:
    """DATA, or the generated default dataset (made on first use)."""
    if data is not None:
        return data
    from fastload.datasets import ensure_default_dataset

    return ensure_default_dataset(progress=True)


def bench_data(*, file_okay: bool = False):
    """The optional DATA argument every ``fastload bench`` command takes [default: the generated dataset]."""
    return click.argument("data", type=click.Path(exists=True, file_okay=file_okay, path_type=Path), required=False)


json_out_option = click.option("--json", "json_out", type=click.Path(path_type=Path), default=None,
                               help="Also write the result here.")


def emit(result: Any, json_out: Path | None) -> None:
    """Print a benchmark's table; with ``--json`` also write its JSON."""
    click.echo(result.table())
    if json_out:
        json_out.write_text(json.dumps(result.to_json(), indent=1))
