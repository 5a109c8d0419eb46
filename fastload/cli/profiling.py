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
@click.option("--seconds", type=click.FloatRange(min=0, min_open=True), default=Default(PROFILE, "seconds"),
              show_default=True,
              help="Measured seconds after warm-up; then the command is ended (whichever of --steps and --seconds "
                   "comes first).")
@click.option("--until-end", is_flag=True, help="Measure until the command ends (no --steps or --seconds limit).")
@click.option("--warmup", type=click.IntRange(min=0), default=Default(PROFILE, "warmup"), show_default=True,
              help="Steps not measured.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Output folder [default: runs/profile-<timestamp>].")
@click.option("--headspace", is_flag=True,
              help="Rerun with the training loader replaying its first batches from memory: the perfect-loader bound.")
@click.option("--verify-fix", is_flag=True,
              help="Rerun with the top change fastload can apply from outside (worker count, pin_memory, the uint8 "
                   "presets on a torchvision ImageFolder; of the store advice, its presets on the files: the store "
                   "itself is the convert) and print predicted vs measured, or 'cannot tell' when the rounds "
                   "disagree.")
@click.option("--verify-change", type=click.Choice(["num_workers", "pin_memory", "uint8_presets"]), default=None,
              help="Implies --verify-fix: verify this change instead of the top one (the top recommendation that "
                   "makes it alone, else its prediction, e.g. one that says it will not help).")
@click.option("--kineto-steps", type=click.IntRange(min=0), default=Default(PROFILE, "kineto_steps"),
              show_default=True,
              help="On CUDA, steps traced with torch.profiler for the GPU timeline (0: off).")
@click.option("--tensorboard", type=click.Path(path_type=Path), default=None,
              help="Also write per-step scalars to this TensorBoard log dir (needs tensorboard).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
@friendly
def profile(steps, seconds, until_end, warmup, out, headspace, verify_fix, verify_change, kineto_steps, tensorboard,
            command) -> None:
    """Run COMMAND unchanged and say where its training step waits: `fastload profile -- python train.py`.

    COMMAND is `python script.py ...`, `python -m pkg.train ...` or `torchrun ... script.py ...`.
    A step is one next() on the training loader (the DataLoader that yields most batches).
    Writes profile.json, profile.png, trace.json (and kineto-rank<R>.json on CUDA) to --out.
    Exits with the command's own exit status when it failed.

    `fastload profile compare A/profile.json B/profile.json` prints two profiles side by side.
    """
    import sys

    from fastload.errors import ProfileError
    from fastload.profiling.compare import compare_profiles, is_compare_call, read_profile
    from fastload.profiling.profile import ProfileOptions, format_summary, run_profile

    if is_compare_call(command):
        click.echo(compare_profiles(read_profile(Path(command[1])), read_profile(Path(command[2])),
                                    names=(command[1], command[2])))
        return
    opts = ProfileOptions(out=out, steps=None if until_end else steps, seconds=None if until_end else seconds,
                          warmup=warmup, headspace=headspace, verify_fix=verify_fix or verify_change is not None,
                          verify_change=verify_change, kineto_steps=kineto_steps,
                          tensorboard=tensorboard)
    try:
        summary = run_profile(list(command), opts)
    except ProfileError as exc:
        if exc.exit_status:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_status)
        raise
    click.echo(format_summary(summary))
    click.echo(f"results: {summary['out']}/profile.json, " + ", ".join(
        f for f in summary["files"] if f != "profile.json"))
    if summary.get("exit_status"):
        sys.exit(summary["exit_status"])
