"""``fastload profile -- COMMAND``: where the user's own training step waits.

Must not: import a room at module level (``--help`` stays fast); do the work.
"""

from __future__ import annotations

from pathlib import Path

import click

from fastload.cli._common import Default, friendly

# the options dataclasses the defaults are read from (imported when a default is needed)
PROFILE = "fastload.profiling.profile:ProfileOptions"


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--steps", type=click.IntRange(min=1), default=Default(PROFILE, "steps"), show_default=True,
              help="Measured steps after warm-up; then the command is ended.")
@click.option("--until-end", is_flag=True, help="Measure until the command ends (no --steps limit).")
@click.option("--warmup", type=click.IntRange(min=0), default=Default(PROFILE, "warmup"), show_default=True,
              help="Steps not measured.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Output folder [default: runs/profile-<timestamp>].")
@click.option("--headspace", is_flag=True,
              help="Rerun with the training loader replaying its first batches from memory: the perfect-loader bound.")
@click.option("--kineto-steps", type=click.IntRange(min=0), default=Default(PROFILE, "kineto_steps"),
              show_default=True,
              help="On CUDA, steps traced with torch.profiler for the GPU timeline (0: off).")
@click.option("--tensorboard", type=click.Path(path_type=Path), default=None,
              help="Also write per-step scalars to this TensorBoard log dir (needs tensorboard).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
@friendly
def profile(steps, until_end, warmup, out, headspace, kineto_steps, tensorboard, command) -> None:
    """Run COMMAND unchanged and say where its training step waits: `fastload profile -- python train.py`.

    COMMAND is `python script.py ...`, `python -m pkg.train ...` or `torchrun ... script.py ...`.
    A step is one next() on the training loader (the DataLoader that yields most batches).
    Writes profile.json, profile.png, trace.json (and kineto-rank<R>.json on CUDA) to --out.
    """
    from fastload.profiling.profile import ProfileOptions, format_summary, run_profile

    opts = ProfileOptions(out=out, steps=None if until_end else steps, warmup=warmup, headspace=headspace,
                          kineto_steps=kineto_steps, tensorboard=tensorboard)
    summary = run_profile(list(command), opts)
    click.echo(format_summary(summary))
    click.echo(f"results: {summary['out']}/profile.json, " + ", ".join(
        f for f in summary["files"] if f != "profile.json"))
