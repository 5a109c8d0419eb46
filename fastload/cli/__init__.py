"""The ``fastload`` command line: parse, build options, call one library function, print.

One module per command group (the list: docs/layout.md). Every fastload error becomes
``error: <message>`` on stderr and exit status 1; Ctrl-C exits with 130 after saying how to
resume. Defaults come from the options dataclasses; heavy modules are imported inside
commands so ``fastload --help`` stays fast.

Must not: do work a library function should do; import a room at module level (one exception:
``fastload.image.DEFAULT_SIZE``, the named default size, whose package imports nothing).
"""

from __future__ import annotations

import click

from fastload.cli import bench, measure, profiling, serve, store

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fastload")
def main() -> None:
    """Keep GPUs busy: pack image datasets into LMDB, load them fast, measure where the step loop waits."""


for _command in (store.convert, store.verify, store.inspect, store.dataset, measure.doctor, bench.bench,
                 serve.serve, profiling.profile, measure.recipe):
    main.add_command(_command)
