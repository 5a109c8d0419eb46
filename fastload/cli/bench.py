"""``fastload bench convert | loader | decode | encode | serve``: side-by-side benchmarks.

The options every benchmark shares (DATA, ``--json``, printing the table) are written once
in ``_common.py``; each command's defaults come from its options dataclass.

Must not: import a room at module level (``--help`` stays fast); do the work.
"""

from __future__ import annotations

from pathlib import Path

import click

from fastload.cli._common import Default, bench_data, data_or_default, emit, friendly, json_out_option

# the options dataclasses the defaults are read from (imported when a default is needed)
LOADER = "fastload.bench.loader:LoaderBenchOptions"
DECODE = "fastload.bench.decode:DecodeBenchOptions"
ENCODE = "fastload.bench.encode:EncodeBenchOptions"
SERVE = "fastload.bench.serve:ServeBenchOptions"


@click.group()
def bench() -> None:
    """Side-by-side benchmarks, reported as ratios against a baseline in the same run."""


@bench.command("convert")
@bench_data(file_okay=True)
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Worker processes for every pass [default: the CPUs this process may use].")
@json_out_option
@click.option("--engine", "engines", default=None,
              help="Compare sharded conversion engines instead, e.g. local,ray: images/s each (Ray's start-up "
                   "included and reported), and how many files make Ray pay.")
@click.option("--num-shards", type=click.IntRange(min=1), default=None, help="--engine: shards [default: files/500].")
@click.option("--to", default=None,
              help="--engine: also upload the shard files to this s3:// prefix, against writing them locally.")
@friendly
def bench_convert_cmd(data: Path | None, workers, json_out: Path | None, engines, num_shards, to) -> None:
    """Conversion images/s against reading (cat) and read+validate of DATA, same pool.

    read+validate runs conversion's own per-file worker (fastload.pack.work:prepare_item).
    With --engine local,ray: the sharded conversion engines side by side instead.

    DATA is an ImageFolder tree or file list [default: the generated default dataset].
    """
    from fastload.bench.convert import bench_convert, bench_engines

    if engines is not None:
        names = tuple(e.strip() for e in engines.split(",") if e.strip())
        bad = [e for e in names if e not in ("local", "ray")]
        if bad or not names:
            raise click.BadParameter(f"unknown engine {bad[0] if bad else engines!r}; valid: local, ray",
                                     param_hint="--engine")
        emit(bench_engines(data_or_default(data), names, num_shards=num_shards, workers=workers, to=to), json_out)
        return
    result = bench_convert(data_or_default(data), workers=workers)
    emit(result, json_out)


@bench.command("loader")
@bench_data()
@click.option("--store", type=click.Path(exists=True, path_type=Path), default=None,
              help="A store of DATA made by `fastload convert` [default: pack a temporary one].")
@click.option("--workers", type=click.IntRange(min=0), default=Default(LOADER, "workers"), show_default=True,
              help="DataLoader workers (DALI threads) for every path.")
@click.option("--batch-size", type=click.IntRange(min=1), default=Default(LOADER, "batch_size"), show_default=True)
@click.option("--image-size", type=click.IntRange(min=8), default=Default(LOADER, "image_size"), show_default=True)
@click.option("--batches", type=click.IntRange(min=1), default=Default(LOADER, "batches"), show_default=True,
              help="Timed batches per path per round.")
@click.option("--rounds", type=click.IntRange(min=1), default=Default(LOADER, "rounds"), show_default=True,
              help="Interleaved rounds (path order rotated each round); the median is reported.")
@click.option("--floor-seconds", type=click.FloatRange(min=0, min_open=True),
              default=Default(LOADER, "floor_seconds"), show_default=True,
              help="Seconds each floor loop (decode alone, the preset's work, normalise; with 2+ workers also the "
                   "preset's work in --workers processes at once, the ceiling) runs in every round, at least (the "
                   "decode and preset loops run whole passes over the floors' crops).")
@click.option("--max-side", type=click.IntRange(min=8), default=None,
              help="Also time a store packed with --max-side N (different data: labelled so).")
@click.option("--reduced-encoding", type=click.Choice(["jpeg", "raw", "auto"]),
              default=Default(LOADER, "reduced_encoding"), show_default=True,
              help="--encoding of the --max-side store (raw: pixels, no decode when training).")
@click.option("--path", "paths", multiple=True, help="Only these paths (repeatable): torchvision, fastload, "
              "fastload-threads, fastload-reduced, webdataset, dali-cpu, spdl, ffcv.")
@click.option("--step-ms", type=click.FloatRange(min=0), default=Default(LOADER, "step_ms"), show_default=True,
              help="A simulated training step after every batch (0: the loader alone).")
@click.option("--host-ms", type=click.FloatRange(min=0), default=Default(LOADER, "host_ms"), show_default=True,
              help="Of each step, host CPU ms holding the GIL (kernel launches; 8 is the measured ResNet-50 cost).")
@click.option("--uint8", is_flag=True, default=False,
              help="Every path hands out uint8 batches, cropped, resized and flipped but not normalised (a GPU "
              "host's case), instead of normalised float32 (FFCV is not run then; not with --remote).")
@click.option("--channels-last", is_flag=True, default=False,
              help="Every path hands out torch.channels_last batches (fastload's presets write them so; other "
              "paths' batches are converted in the timed loop). Not with --remote.")
@click.option("--remote", default=None, metavar="URL",
              help="Instead: the sharded store at URL (s3://, gs://, az://) with a cold and a warm node cache "
              "against --store, the same store on local disk (fastload.bench.remote).")
@click.option("--mosaic", default=None, metavar="URL",
              help="With --remote: also MosaicML Streaming reading the same images as MDS at URL (cold and warm; "
              "fastload.bench.remote.write_mds writes them; needs `pip install mosaicml-streaming`).")
@click.option("--litdata", default=None, metavar="URL",
              help="With --remote: also LitData reading the same images as its optimize() chunks at URL (cold and "
              "warm; fastload.bench.remote.write_litdata writes them; needs `pip install litdata`).")
@click.option("--dali", is_flag=True, default=False,
              help="With --remote: also DALILoader on the CPU over --store and over the URL (cold and warm), "
              "compared with each other; needs `pip install fastload[dali]`.")
@json_out_option
@friendly
def bench_loader_cmd(data, store, workers, batch_size, image_size, batches, rounds, floor_seconds, max_side,
                     reduced_encoding, paths, step_ms, host_ms, uint8, channels_last, remote, mosaic, litdata, dali,
                     json_out) -> None:
    """Images/s of torchvision vs fastload (vs WebDataset, DALI CPU, SPDL, FFCV) on the same DATA.

    DATA is an ImageFolder tree [default: the generated default dataset]. Same batch size,
    same workers, interleaved rounds in one process tree, each path's workers shut down
    before the next is timed; ratios against torchvision, also per round. A path that
    cannot run on DATA is reported skipped with the reason.
    """
    for flag, given in (("--mosaic", mosaic), ("--litdata", litdata), ("--dali", dali or None)):
        if given is not None and remote is None:
            raise click.UsageError(f"{flag}{'' if flag == '--dali' else ' URL'} is compared with --remote URL: "
                                   "give both (and --store).")
    for flag, given in (("--uint8", uint8), ("--channels-last", channels_last)):
        if remote is not None and given:
            raise click.UsageError(f"{flag} is for the local paths; --remote compares the same store local and "
                                   "remote with normalised float batches.")
    if remote is not None:
        from fastload.bench.remote import RemoteBenchOptions, bench_remote

        if store is None:
            raise click.UsageError("--remote URL needs --store: the same sharded store on local disk.")
        emit(bench_remote(store, remote, RemoteBenchOptions(workers=workers, batch_size=batch_size,
                                                            image_size=image_size, rounds=rounds),
                          mosaic_url=mosaic, litdata_url=litdata, dali=dali), json_out)
        return
    from fastload.bench.loader import LoaderBenchOptions, bench_loader

    opts = LoaderBenchOptions(workers=workers, batch_size=batch_size, image_size=image_size, batches=batches,
                              rounds=rounds, max_side=max_side, reduced_encoding=reduced_encoding,
                              paths=tuple(paths) or None, step_ms=step_ms, host_ms=host_ms, uint8=uint8,
                              floor_seconds=floor_seconds, channels_last=channels_last)
    result = bench_loader(data_or_default(data), store=store, options=opts)
    emit(result, json_out)


def per_image_options(defaults: str, *, images: str, rounds: str, size: str):
    """``--images``, ``--rounds`` and ``--size`` of a per-image benchmark (decode, encode): the help texts
    given, the defaults read from the ``defaults`` options dataclass."""
    def wrap(f):
        f = click.option("--size", type=click.IntRange(min=8), default=Default(defaults, "size"), show_default=True,
                         help=size)(f)
        f = click.option("--rounds", type=click.IntRange(min=1), default=Default(defaults, "rounds"),
                         show_default=True, help=rounds)(f)
        return click.option("--images", type=click.IntRange(min=1), default=Default(defaults, "images"),
                            show_default=True, help=images)(f)
    return wrap


@bench.command("decode")
@bench_data()
@per_image_options(DECODE, images="JPEGs of DATA to time (the first N).",
                   rounds="Interleaved rounds; the median is reported.", size="Crop output side.")
@json_out_option
@friendly
def bench_decode_cmd(data: Path | None, images: int, rounds: int, size: int, json_out: Path | None) -> None:
    """Milliseconds per image, one core: region vs full decode, simplejpeg vs Pillow, resize kernels.

    DATA is a folder with JPEGs [default: the generated default dataset].
    """
    from fastload.bench.decode import DecodeBenchOptions, bench_decode

    result = bench_decode(data_or_default(data), DecodeBenchOptions(images=images, rounds=rounds, size=size))
    emit(result, json_out)


@bench.command("encode")
@bench_data()
@per_image_options(ENCODE, images="Images of DATA to measure (the first N readable ones, any format).",
                   rounds="Interleaved timing rounds; the median is reported.", size="Train preset crop size.")
@json_out_option
@friendly
def bench_encode_cmd(data: Path | None, images: int, rounds: int, size: int, json_out: Path | None) -> None:
    """How to store non-JPEG sources: lossless PNG vs WebP lossless vs JPEG q95 4:4:4 (and q90 4:2:0).

    Bits per pixel, encode cost, the train preset's time per image on one thread, and PSNR.
    DATA is an image folder [default: the generated default dataset].
    """
    from fastload.bench.encode import EncodeBenchOptions, bench_encode

    result = bench_encode(data_or_default(data), EncodeBenchOptions(images=images, rounds=rounds, size=size))
    emit(result, json_out)


@bench.command("serve")
@click.option("--model", type=str, default=Default(SERVE, "model"), show_default=True,
              help="'simulated' (a device that sleeps --batch-ms per batch) or a torchvision model (run on --device).")
@click.option("--batch-ms", type=str, default=Default(SERVE, "batch_ms"), show_default=True,
              help="The simulated device's ms per batch of n, 'A+B*n'.")
@click.option("--max-batch", type=click.IntRange(min=1), default=Default(SERVE, "max_batch"), show_default=True)
@click.option("--loads", type=str, default=Default(SERVE, "loads", lambda v: ",".join(f"{x:g}" for x in v)),
              show_default=True,
              help="Offered loads as fractions of the estimated capacity (past 1 is past saturation).")
@click.option("--rates", default=None, help="Offered loads in requests/s instead, comma-separated.")
@click.option("--configs", type=str, default=Default(SERVE, "configs", ",".join), show_default=True,
              help="Which configurations to run, comma-separated.")
@click.option("--rounds", type=click.IntRange(min=1), default=Default(SERVE, "rounds"), show_default=True,
              help="Interleaved rounds; each point reports the median and the range.")
@click.option("--duration", type=click.FloatRange(min=0.1), default=Default(SERVE, "duration_s"), show_default=True,
              help="Seconds per point.")
@click.option("--max-requests", type=click.IntRange(min=1), default=Default(SERVE, "max_requests"), show_default=True)
@click.option("--image-size", type=click.IntRange(min=32), default=Default(SERVE, "image_size"), show_default=True)
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="fastload's preprocessing threads [default: the CPUs this process may use].")
@click.option("--device", type=str, default=Default(SERVE, "device"), show_default=True,
              help="Where the model runs: cpu, cuda, cuda:N, auto.")
@click.option("--fronts", default=None,
              help="Compare HTTP fronts instead of configurations: 'stdlib,asgi' runs each as a fastload serve "
                   "process (its defaults) under the same load; adds server CPU per request and RSS.")
@json_out_option
@friendly
def bench_serve_cmd(model, batch_ms, max_batch, loads, rates, configs, rounds, duration, max_requests, image_size,
                    workers, device, fronts, json_out) -> None:
    """Serving before/after: the seed's (Pillow, one at a time, 50 ms wait) vs fastload's, at several loads.

    Open-loop Poisson load over loopback HTTP; throughput, p50/p99, device busy fraction.
    With --fronts stdlib,asgi: the two HTTP fronts side by side instead.
    """
    from fastload.bench.serve import ServeBenchOptions, bench_serve, format_table, to_json

    def floats(text: str, what: str) -> tuple[float, ...]:
        try:
            return tuple(float(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise click.BadParameter(f"{what} must be comma-separated numbers, got {text!r}") from None

    try:
        opts = ServeBenchOptions(model=model, batch_ms=batch_ms, max_batch=max_batch, loads=floats(loads, "--loads"),
                                 rates=floats(rates, "--rates") if rates else None,
                                 configs=tuple(c.strip() for c in configs.split(",") if c.strip()), rounds=rounds,
                                 duration_s=duration, max_requests=max_requests, image_size=image_size,
                                 workers=workers, device=device)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    if fronts:
        from fastload.serve.asgi import require
        from fastload.bench.fronts import bench_fronts, check_fronts, format_fronts_table

        chosen = tuple(f.strip() for f in fronts.split(",") if f.strip())
        try:
            check_fronts(chosen)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from exc
        require()  # a missing serve extra fails here, not in a server process
        report = bench_fronts(opts, chosen)
        click.echo(format_fronts_table(report))
    else:
        report = bench_serve(opts)
        click.echo(format_table(report))
    if json_out:
        json_out.write_text(to_json(report))
