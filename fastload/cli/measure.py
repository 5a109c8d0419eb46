"""``fastload doctor`` and ``fastload recipe run | compare``: the machine's facts and the A/B runner.

Must not: import a room at module level (``--help`` stays fast); do the work.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from fastload.cli._common import friendly
from fastload.image import DEFAULT_SIZE


@click.command()
@click.option("--batch-size", type=click.IntRange(min=1), default=256, show_default=True,
              help="Batch size for the pinned-memory estimate.")
@click.option("--image-size", type=click.IntRange(min=8), default=DEFAULT_SIZE, show_default=True)
@click.option("--prefetch-factor", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@friendly
def doctor(batch_size: int, image_size: int, prefetch_factor: int, as_json: bool) -> None:
    """What this machine offers a data pipeline: CPUs, GPUs, recommended workers, pinned memory, versions."""
    from fastload.measure.doctor import doctor_report, format_doctor

    report = doctor_report(batch_size=batch_size, image_size=image_size, prefetch_factor=prefetch_factor)
    click.echo(json.dumps(report, indent=1) if as_json else format_doctor(report))


@click.group()
def recipe() -> None:
    """Run a recipe (recipes/*.toml): every loader stage on the same data, measured."""


@recipe.command("run")
@click.argument("recipe_file", metavar="RECIPE", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Output folder [default: runs/<recipe name>-<data name>, numbered -2, -3, ... when taken].")
@click.option("--force", is_flag=True, help="Overwrite the results already in --out.")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Override run.steps.")
@click.option("--warmup", type=click.IntRange(min=0), default=None, help="Override run.warmup.")
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help="Override run.batch_size.")
@click.option("--image-size", type=click.IntRange(min=8), default=None, help="Override run.image_size.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None, help="Override run.device.")
@click.option("--model", default=None, help="Override run.model ('simulated' or a torchvision model name).")
@click.option("--step-ms", type=click.FloatRange(min=0), default=None, help="Override run.step_ms.")
@click.option("--host-ms", type=click.FloatRange(min=0), default=None,
              help="Override run.host_ms: the simulated step's host CPU ms per batch, holding the GIL "
                   "(kernel launches) [default: the measured ResNet-50 launch cost].")
@click.option("--folder", default=None, help="Override dataset.folder (an ImageFolder tree, or 'default').")
@click.option("--store", default=None, help="Override dataset.store (converted from the folder if missing).")
@click.option("--rounds", type=click.IntRange(min=1), default=None,
              help="Override run.rounds: interleaved rounds, stage order rotated each round.")
@click.option("--cache", type=click.Choice(["warm", "cold"]), default=None,
              help="Override dataset.cache (cold: evict the data from the page cache before every stage).")
@click.option("--read-delay-ms", type=click.FloatRange(min=0), default=None,
              help="Override dataset.read_delay_ms (emulated latency per file opened).")
@click.option("--stage", "stages", multiple=True, help="Run only this stage (repeatable).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@friendly
def recipe_run(recipe_file: Path, out: Path | None, force: bool, steps, warmup, batch_size, image_size, device, model,
               step_ms, host_ms, folder, store, rounds, cache, read_delay_ms, stages, quiet) -> None:
    """Run every stage of RECIPE in interleaved rounds, print the comparison table, write results to --out.

    Each stage's figure is the median over rounds with a 95% interval. Writes
    results.json (figures, every round, resolved recipe, environment), results.csv,
    comparison.png and traces/<stage>.json (Chrome trace: open in ui.perfetto.dev).
    """
    from fastload.measure.recipe import load_recipe, run_recipe, selected_stages, validate
    from fastload.measure.report import check_out, format_table, new_run_folder, write_outputs
    from fastload.measure.train import distributed_run
    from fastload.progress import bar as progress_bar

    rec = load_recipe(recipe_file).with_overrides(**{
        "run.steps": steps, "run.warmup": warmup, "run.batch_size": batch_size, "run.image_size": image_size,
        "run.device": device, "run.model": model, "run.step_ms": step_ms, "run.host_ms": host_ms,
        "run.rounds": rounds,
        "dataset.folder": folder, "dataset.store": store, "dataset.cache": cache,
        "dataset.read_delay_ms": read_delay_ms})
    validate(rec)
    # the group is left on every rank once the figures are gathered (a rank that exits with it alive can abort)
    with distributed_run() as (rank, world):
        lead = rank == 0
        total = len(selected_stages(rec, stages)) * rec.run.rounds * (rec.run.warmup + rec.run.steps)
        if out is not None and lead:
            check_out(out, force=force)  # before minutes of measuring, not after
        bar = progress_bar(total=total, unit="step", disable=quiet or not lead)

        current = [""]

        def on_step(name: str) -> None:
            if current[0] != name:  # redraw once per stage change, not per step (log files)
                current[0] = name
                bar.set_description(f"stage {name}")
            bar.update()

        outcomes, data = run_recipe(rec, progress=not quiet and lead, only=stages or None, on_step=on_step)
    bar.close()
    if not lead:
        return
    out = out or new_run_folder(Path("runs"), rec.name, data.name)
    results, notes = write_outputs(out, rec, outcomes, data)
    click.echo(f"\n{rec.name}: {rec.run.model}"
               + (f" ({rec.run.step_ms:g} ms/batch simulated device step, {rec.run.host_ms:g} ms of it host CPU "
                  "holding the GIL)" if rec.run.model == "simulated" else "")
               + f", batch {rec.run.batch_size}, {rec.run.rounds} x {rec.run.steps} steps after {rec.run.warmup} "
               + f"warm-up, cache {rec.dataset.cache}"
               + (f", {rec.dataset.read_delay_ms:g} ms per file opened" if rec.dataset.read_delay_ms else "")
               + ", "
               + f"device {outcomes[0].result.device if outcomes and outcomes[0].result else rec.run.device}"
               + (f", {world} ranks" if world > 1 else ""))
    click.echo(f"data: {data.describe()}")
    click.echo(format_table(results["stages"]))
    click.echo(f"\nverdict: {results['verdict']}")
    for note in notes:
        click.echo(note)
    click.echo(f"results: {out}/results.json, results.csv, comparison.png, traces/")


@recipe.command("compare")
@click.argument("a", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("b", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@friendly
def recipe_compare(a: Path, b: Path) -> None:
    """Print two results.json side by side, stage by stage, with B/A ratios ("~": intervals overlap).

    Two profile.json files (from `fastload profile`) are compared as `fastload profile compare` does.
    """
    from fastload.measure.report import compare_results
    from fastload.profiling.compare import compare_profiles, read_result_or_profile

    (kind_a, ra), (kind_b, rb) = read_result_or_profile(a), read_result_or_profile(b)
    if kind_a == kind_b == "profile":
        click.echo(compare_profiles(ra, rb, names=(str(a), str(b))))
        return
    if kind_a != kind_b:
        wrong = a if kind_a == "profile" else b
        raise click.ClickException(f"{wrong} is a profile.json (from `fastload profile`), the other a recipe's "
                                   "results.json: they cannot be compared\nHINT: compare two results.json, or "
                                   "two profile.json with `fastload profile compare A/profile.json B/profile.json`")
    click.echo(compare_results(ra, rb))
