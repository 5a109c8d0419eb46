"""The ``fastload`` command line: parse, build options, call one library function, print.

Every fastload error becomes ``error: <message>`` on stderr and exit status 1; Ctrl-C
exits with 130 after saying how to resume. Heavy modules are imported inside commands so
``fastload --help`` stays fast.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from fastload.errors import FastloadError


def _printable(text: str) -> str:
    """File names that are not valid UTF-8 (kept with surrogateescape) shown with U+FFFD, never a crash."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _friendly(fn):
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fastload")
def main() -> None:
    """Keep GPUs busy: pack image datasets into LMDB, load them fast, measure where the step loop waits."""


@main.command()
@click.argument("src", type=click.Path(exists=True, path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--max-side", type=click.IntRange(min=8), default=None,
              help="Downscale images whose LONGER side exceeds N to N (re-encoded as JPEG).")
@click.option("--quality", type=click.IntRange(1, 100), default=None,
              help="JPEG quality for re-encoding [default: 90 with --max-side]. Alone, re-encodes every image.")
@click.option("--encoding", type=click.Choice(["jpeg", "raw", "auto"]), default="jpeg", show_default=True,
              help="jpeg: encoded images (originals where every decoder agrees); raw: RGB pixels, no decode when "
                   "training (10-15x the bytes); auto: raw up to 256x256 pixels (after --max-side), jpeg above.")
@click.option("--lossless", is_flag=True,
              help="Keep non-JPEG sources (PNG, WebP, TIFF, ...) pixel-exact as PNG. By default they are stored as "
                   "JPEG q95 4:4:4, which loads about 4-5x faster (see `fastload bench encode`); the PSNR is reported.")
@click.option("--train-size", type=click.IntRange(min=8), default=224, show_default=True,
              help="Training crop size the --max-side advice printed after the conversion is for.")
@click.option("--shuffle/--no-shuffle", default=False, help="Write samples in a seeded random order.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for --shuffle.")
@click.option("--num-shards", type=click.IntRange(min=1), default=1, show_default=True,
              help="Split the dataset into K shards (one machine each).")
@click.option("--shard-index", type=click.IntRange(min=0), default=0, show_default=True,
              help="Which shard this run packs, written to DST/shard-IIIII-of-KKKKK.")
@click.option("--strict", is_flag=True, help="Stop at the first unreadable file instead of skipping it.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Validation processes [default: the CPUs this process may use].")
@click.option("--max-pixels", type=click.IntRange(min=1), default=None,
              help="Refuse larger images as decompression bombs [default: Pillow's limit, 178,956,970].")
@click.option("--chunk-size", type=click.IntRange(min=1), default=256, show_default=True,
              help="Samples per write transaction.")
@click.option("--max-file-bytes", type=click.IntRange(min=1), default=None,
              help="Skip files larger than this, unread [default: 1 GiB].")
@click.option("--follow-symlinks", is_flag=True,
              help="Read symbolic links that point outside SRC (by default they are skipped and reported).")
@click.option("--num-classes", type=click.IntRange(min=1), default=None,
              help="File lists with integer labels: the number of classes (labels must be 0..N-1).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@_friendly
def convert(src: Path, dst: Path, max_side, quality, encoding, lossless, train_size, shuffle, seed, num_shards,
            shard_index, strict, workers, max_pixels, chunk_size, max_file_bytes, follow_symlinks, num_classes,
            quiet) -> None:
    """Pack SRC (an ImageFolder tree, or a CSV/TSV list of path,label) into the LMDB store DST.

    Every file is decoded once; unreadable ones are skipped and listed in DST/report.json.
    Interrupt it at any moment and rerun the same command to resume. When the stored images
    are far larger than --train-size needs, it measures and prints the --max-side that would
    load faster.
    """
    from fastload.pack.convert import ConvertOptions
    from fastload.pack.convert import convert as run
    from fastload.image.policy import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_PIXELS

    if shard_index >= num_shards:
        raise click.BadParameter(f"must be < --num-shards ({num_shards})", param_hint="--shard-index")
    if lossless and (max_side is not None or quality is not None):
        raise click.BadParameter("cannot be combined with --max-side or --quality, which re-encode as lossy JPEG "
                                 "(for exact downscaled pixels: --max-side N --encoding raw)", param_hint="--lossless")
    opts = ConvertOptions(max_side=max_side, quality=quality, encoding=encoding, lossless=lossless,
                          shuffle=shuffle, seed=seed,
                          num_shards=num_shards, shard_index=shard_index, strict=strict, workers=workers,
                          chunk_size=chunk_size, max_pixels=max_pixels or DEFAULT_MAX_PIXELS,
                          max_file_bytes=max_file_bytes or DEFAULT_MAX_FILE_BYTES, follow_symlinks=follow_symlinks,
                          num_classes=num_classes, progress=not quiet)
    report = run(src, dst, opts)
    for w in report.warnings:
        click.echo(f"warning: {_printable(w)}", err=True)
    click.echo(report.summary_line())
    for s in report.skipped[:20]:
        click.echo(f"  skipped {_printable(s['relpath'])}: {_printable(s['reason'])}")
    if len(report.skipped) > 20:
        click.echo(f"  ... and {len(report.skipped) - 20} more, see {report.dst / 'report.json'}")
    _print_reasons(report.canonicalised, report.reencoded_reasons, report.lossy, indent="  ")
    if max_side is None and report.stored and not report.already_complete and num_shards == 1:
        advice = _advice(report.dst, train_size)
        if isinstance(advice, str) or advice.speedup is not None:  # measured only for images far larger
            click.echo(advice if isinstance(advice, str) else advice.message(str(src)))


def _advice(store: Path, train_size: int):
    """The --max-side advice, or one line saying why it is missing: the store is written either way."""
    from fastload.measure.advice import max_side_advice

    try:
        return max_side_advice(store, size=train_size)
    except Exception as exc:  # noqa: BLE001 - advice is extra; a failure must not fail the command
        return f"--max-side advice not measured: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _print_reasons(canonicalised: dict, reencoded: dict, lossy: dict, indent: str) -> None:
    for reason, n in canonicalised.items():
        click.echo(f"{indent}canonicalised {n}: {reason}")
    for reason, n in reencoded.items():
        click.echo(f"{indent}re-encoded {n}: {reason}")
    if lossy.get("count"):
        median = lossy["psnr_median"]
        median = f"{median:.1f}" if isinstance(median, (int, float)) else "/".join(f"{m:.1f}" for m in median if m)
        click.echo(f"{indent}lossy writes {lossy['count']}: PSNR min {lossy['psnr_min']:.1f} dB, median {median} dB "
                   "(against the pixels encoded)")


@main.command()
@click.argument("store", type=click.Path(path_type=Path))
@click.option("--no-decode", is_flag=True, help="Check checksums only; do not decode.")
@click.option("--decoders", default="fastload", show_default=True,
              help="Comma-separated decoders to check every record with: fastload (the loaders' fast path), "
                   "pil, torchvision, simplejpeg, dali; or 'all'.")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Reader processes.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@_friendly
def verify(store: Path, no_decode: bool, decoders: str, workers, as_json: bool, quiet: bool) -> None:
    """Re-read every record of STORE: metadata and record checksums, and a decode with each decoder
    (crash-isolated), compared with Pillow's pixels; exit 1 on any problem."""
    from fastload.store.check import DECODERS, report_json, verify_store

    names = DECODERS if decoders.strip() == "all" else tuple(d.strip() for d in decoders.split(",") if d.strip())
    unknown = [d for d in names if d not in DECODERS]
    if unknown:
        raise click.BadParameter(f"unknown decoder {unknown[0]!r}; valid: {', '.join(DECODERS)}, all",
                                 param_hint="--decoders")
    report = verify_store(store, decode=not no_decode, decoders=names, workers=workers,
                          progress=not quiet and not as_json)
    if as_json:
        click.echo(report_json(report))
    else:
        for i, rel, why in report.failures:
            click.echo(f"sample {i} ({_printable(rel)}): {why}")
        state = "OK" if report.ok else f"{len(report.failures)} problems"
        per = ", ".join(f"{d} {len(ix)} bad" for d, ix in report.by_decoder().items() if ix)
        checked = "checksums" + (f", decoders {', '.join(report.decoders)}" if report.decoders else "")
        click.echo(f"{store}: {report.count} samples checked, {state} ({checked}" + (f"; {per})" if per else ")"))
    if not report.ok:
        sys.exit(1)


@main.command()
@click.argument("store", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON.")
@click.option("--train-size", type=click.IntRange(min=8), default=224, show_default=True,
              help="Training crop size for the --max-side advice.")
@click.option("--advise/--no-advise", default=True, show_default=True,
              help="Sample the store and, when its images are far larger than --train-size needs, measure and "
                   "print the --max-side that would load faster (a few seconds on big images).")
@_friendly
def inspect(store: Path, as_json: bool, train_size: int, advise: bool) -> None:
    """Show what STORE holds: count, classes, bytes, encodings, options, completeness, size advice."""
    from fastload.store.check import inspect_store

    info = inspect_store(store)
    advice = None
    if advise and info["complete"] and info["count"]:
        advice = _advice(store, train_size)
        info["max_side_advice"] = advice if isinstance(advice, str) else advice.to_json()
    if as_json:
        click.echo(json.dumps(info, indent=1))
        return
    if not info["complete"]:
        click.echo(f"{store}: INCOMPLETE\n{info['problem']}")
        sys.exit(1)
    click.echo(f"{info['path']}: complete, format v{info['format_version']}"
               + (f", {info['shards']} shards" if info["shards"] else ""))
    click.echo(f"  samples   {info['count']}  ({info['bytes'] / 1e6:.1f} MB, {info['bytes_per_image'] / 1e3:.1f} kB "
               f"an image, {info['skipped']} skipped at conversion)")
    click.echo(f"  source    {info['source']['kind']} {info['source']['path']}")
    click.echo(f"  encodings {', '.join(f'{k} {v}' for k, v in info['encodings'].items())}")
    click.echo(f"  stored as {', '.join(f'{k} {v}' for k, v in info['stored_as'].items())}")
    _print_reasons(info["canonicalised"], info["reencoded"], info["lossy"], indent="    ")
    opts = info["options"] if isinstance(info["options"], dict) else info["options"][0]
    click.echo("  options   " + ", ".join(f"{k}={v}" for k, v in opts.items() if k not in ("shard_index",)))
    click.echo(f"  classes   {len(info['classes'])}")
    for name, n in info["classes"].items():
        click.echo(f"    {n:8d}  {name}")
    if advice is not None:
        click.echo(f"  size      {advice if isinstance(advice, str) else advice.message(info['source']['path'])}")


@main.command("dataset")
@click.argument("directory", type=click.Path(path_type=Path), required=False)
@click.option("--classes", "num_classes", type=click.IntRange(1, 16), default=None,
              help="Number of classes [default: 10].")
@click.option("--per-class", type=click.IntRange(min=1), default=None, help="Images per class [default: 80].")
@click.option("--seed", type=int, default=None, help="Seed [default: 0].")
@click.option("--min-side", type=click.IntRange(min=16), default=None,
              help="Shorter side of the images, at least [default: 200]; e.g. 3000 for a folder of 12-24 MP photos.")
@click.option("--max-side", type=click.IntRange(min=16), default=None, help="Longer side, at most [default: 800].")
@click.option("--png-every", type=click.IntRange(min=0), default=None,
              help="Every N-th image of a class is a PNG (0: none) [default: 40].")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@_friendly
def dataset(directory: Path | None, num_classes, per_class, seed, min_side, max_side, png_every, quiet) -> None:
    """Generate the default dataset (synthetic photos, made offline) (an ImageFolder tree) and print its path.

    Without DIRECTORY it goes to the cache (~/.cache/fastload, or $FASTLOAD_CACHE), where
    recipes find it.
    """
    from dataclasses import replace

    from fastload.datasets import DEFAULT_SPEC, default_dataset_dir, make_dataset

    overrides = {k: v for k, v in {"num_classes": num_classes, "per_class": per_class, "seed": seed,
                                    "min_side": min_side, "max_side": max_side, "png_every": png_every}.items()
                 if v is not None}
    spec = replace(DEFAULT_SPEC, **overrides)
    if directory is None:
        if overrides:
            raise click.BadParameter("options that change the data need an explicit DIRECTORY",
                                     param_hint="DIRECTORY")
        directory = default_dataset_dir()
    click.echo(make_dataset(directory, spec, progress=not quiet))


@main.command()
@click.option("--batch-size", type=click.IntRange(min=1), default=256, show_default=True,
              help="Batch size for the pinned-memory estimate.")
@click.option("--image-size", type=click.IntRange(min=8), default=224, show_default=True)
@click.option("--prefetch-factor", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_friendly
def doctor(batch_size: int, image_size: int, prefetch_factor: int, as_json: bool) -> None:
    """What this machine offers a data pipeline: CPUs, GPUs, recommended workers, pinned memory, versions."""
    from fastload.measure.doctor import doctor_report, format_doctor

    report = doctor_report(batch_size=batch_size, image_size=image_size, prefetch_factor=prefetch_factor)
    click.echo(json.dumps(report, indent=1) if as_json else format_doctor(report))


@main.group()
def bench() -> None:
    """Side-by-side benchmarks, reported as ratios against a baseline in the same run."""


def _data_or_default(data: Path | None) -> Path:
    if data is not None:
        return data
    from fastload.datasets import ensure_default_dataset

    return ensure_default_dataset(progress=True)


@bench.command("convert")
@click.argument("data", type=click.Path(exists=True, path_type=Path), required=False)
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Worker processes for every pass [default: the CPUs this process may use].")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="Also write the result here.")
@_friendly
def bench_convert_cmd(data: Path | None, workers, json_out: Path | None) -> None:
    """Conversion images/s against reading (cat) and read+validate of DATA, same pool.

    read+validate runs conversion's own per-file worker (fastload.image.policy:prepare_file).

    DATA is an ImageFolder tree or file list [default: the generated default dataset].
    """
    from fastload.measure.bench_convert import bench_convert

    result = bench_convert(_data_or_default(data), workers=workers)
    click.echo(result.table())
    if json_out:
        json_out.write_text(json.dumps(result.to_json(), indent=1))


@bench.command("loader")
@click.argument("data", type=click.Path(exists=True, file_okay=False, path_type=Path), required=False)
@click.option("--store", type=click.Path(exists=True, path_type=Path), default=None,
              help="A store of DATA made by `fastload convert` [default: pack a temporary one].")
@click.option("--workers", type=click.IntRange(min=0), default=2, show_default=True,
              help="DataLoader workers (DALI threads) for every path.")
@click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--image-size", type=click.IntRange(min=8), default=224, show_default=True)
@click.option("--batches", type=click.IntRange(min=1), default=30, show_default=True,
              help="Timed batches per path per round.")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Interleaved rounds (path order rotated each round); the median is reported.")
@click.option("--max-side", type=click.IntRange(min=8), default=None,
              help="Also time a store packed with --max-side N (different data: labelled so).")
@click.option("--reduced-encoding", type=click.Choice(["jpeg", "raw", "auto"]), default="jpeg", show_default=True,
              help="--encoding of the --max-side store (raw: pixels, no decode when training).")
@click.option("--path", "paths", multiple=True, help="Only these paths (repeatable): torchvision, fastload, "
              "fastload-threads, fastload-reduced, webdataset, dali-cpu, spdl, ffcv.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="Also write the result here.")
@_friendly
def bench_loader_cmd(data, store, workers, batch_size, image_size, batches, rounds, max_side, reduced_encoding, paths,
                     json_out) -> None:
    """Images/s of torchvision vs fastload (vs WebDataset, DALI CPU, SPDL, FFCV) on the same DATA.

    DATA is an ImageFolder tree [default: the generated default dataset]. Same batch size,
    same workers, interleaved rounds in one process tree, each path's workers shut down
    before the next is timed; ratios against torchvision, also per round. A path that
    cannot run on DATA is reported skipped with the reason.
    """
    from fastload.measure.bench_loader import LoaderBenchOptions, bench_loader

    opts = LoaderBenchOptions(workers=workers, batch_size=batch_size, image_size=image_size, batches=batches,
                              rounds=rounds, max_side=max_side, reduced_encoding=reduced_encoding,
                              paths=tuple(paths) or None)
    result = bench_loader(_data_or_default(data), store=store, options=opts)
    click.echo(result.table())
    if json_out:
        json_out.write_text(json.dumps(result.to_json(), indent=1))


@bench.command("decode")
@click.argument("data", type=click.Path(exists=True, file_okay=False, path_type=Path), required=False)
@click.option("--images", type=click.IntRange(min=1), default=200, show_default=True,
              help="JPEGs of DATA to time (the first N).")
@click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True,
              help="Interleaved rounds; the median is reported.")
@click.option("--size", type=click.IntRange(min=8), default=224, show_default=True, help="Crop output side.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="Also write the result here.")
@_friendly
def bench_decode_cmd(data: Path | None, images: int, rounds: int, size: int, json_out: Path | None) -> None:
    """Milliseconds per image, one core: region vs full decode, simplejpeg vs Pillow, resize kernels.

    DATA is a folder with JPEGs [default: the generated default dataset].
    """
    from fastload.measure.bench_decode import DecodeBenchOptions, bench_decode

    result = bench_decode(_data_or_default(data), DecodeBenchOptions(images=images, rounds=rounds, size=size))
    click.echo(result.table())
    if json_out:
        json_out.write_text(json.dumps(result.to_json(), indent=1))


@bench.command("encode")
@click.argument("data", type=click.Path(exists=True, file_okay=False, path_type=Path), required=False)
@click.option("--images", type=click.IntRange(min=1), default=24, show_default=True,
              help="Images of DATA to measure (the first N readable ones, any format).")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Interleaved timing rounds; the median is reported.")
@click.option("--size", type=click.IntRange(min=8), default=224, show_default=True, help="Train preset crop size.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="Also write the result here.")
@_friendly
def bench_encode_cmd(data: Path | None, images: int, rounds: int, size: int, json_out: Path | None) -> None:
    """How to store non-JPEG sources: lossless PNG vs WebP lossless vs JPEG q95 4:4:4 (and q90 4:2:0).

    Bits per pixel, encode cost, the train preset's time per image on one thread, and PSNR.
    DATA is an image folder [default: the generated default dataset].
    """
    from fastload.measure.bench_encode import EncodeBenchOptions, bench_encode

    result = bench_encode(_data_or_default(data), EncodeBenchOptions(images=images, rounds=rounds, size=size))
    click.echo(result.table())
    if json_out:
        json_out.write_text(json.dumps(result.to_json(), indent=1))


@main.command()
@click.option("--model", "model_name", required=True,
              help="A torchvision.models classification model name, or 'simulated' (with --batch-ms).")
@click.option("--batch-ms", default=None,
              help="For --model simulated: device time per batch of n as 'A+B*n' ms (it sleeps, freeing the CPU).")
@click.option("--weights", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A state_dict file for the model [default: random initialisation; nothing is downloaded].")
@click.option("--num-classes", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--classes", "classes_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="A text file with one class name per line, for the JSON answers.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--max-batch", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--max-wait-ms", type=click.FloatRange(min=0), default=8.0, show_default=True,
              help="How long a partial batch may wait for more requests (0: greedy).")
@click.option("--max-queue", type=click.IntRange(min=1), default=256, show_default=True,
              help="Requests waiting per replica before new ones get 503 + Retry-After.")
@click.option("--devices", default="auto", show_default=True,
              help="Comma-separated devices, one replica each: auto, cpu, cuda, cuda:0,cuda:1.")
@click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True,
              help="Replicas on the CPU (with --devices cpu).")
@click.option("--cpu-fallback/--no-cpu-fallback", default=True, show_default=True,
              help="Beside CUDA replicas, keep a CPU replica that retries a failed device's requests.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default="fp32", show_default=True)
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Preprocessing threads in all [default: the CPUs this process may use].")
@click.option("--size", type=click.IntRange(min=8), default=224, show_default=True, help="Eval crop size.")
@click.option("--resize", type=click.IntRange(min=8), default=256, show_default=True,
              help="Shorter side before the crop.")
@click.option("--gpu-decode-min-batch", type=click.IntRange(min=1), default=None,
              help="On CUDA, decode batches of at least N JPEGs on the GPU (nvJPEG).")
@click.option("--max-pixels", type=click.IntRange(min=1), default=40_000_000, show_default=True,
              help="Refuse images declaring more pixels (checked from the header, before decoding).")
@click.option("--max-body-mb", type=click.FloatRange(min=0.001), default=64.0, show_default=True,
              help="Bodies over this get 413, answered before the body is read.")
@click.option("--request-timeout", type=click.FloatRange(min=0.001), default=30.0, show_default=True,
              help="Seconds before a request gets 504 and leaves the queue.")
@click.option("--header-timeout", type=click.FloatRange(min=0.001), default=10.0, show_default=True,
              help="Seconds for a request line and headers to arrive, in total (on asgi: added to uvicorn's "
                   "protocol, needs httptools).")
@click.option("--body-timeout", type=click.FloatRange(min=0.001), default=30.0, show_default=True,
              help="Seconds for a body to arrive.")
@click.option("--idle-timeout", type=click.FloatRange(min=0.001), default=15.0, show_default=True,
              help="Seconds an idle keep-alive connection stays open.")
@click.option("--max-connections", type=click.IntRange(min=1), default=256, show_default=True,
              help="Open connections (stdlib: one thread each); more get 503 + Retry-After (asgi: a request "
                   "arriving over the cap).")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=25.0, show_default=True,
              help="On SIGTERM, seconds to finish accepted requests.")
@click.option("--front", type=click.Choice(["stdlib", "asgi"]), default="stdlib", show_default=True,
              help="HTTP front: the standard library's (a thread per connection, every timeout above) or uvicorn + "
                   "starlette ('fastload[serve]' extra: an event loop, no thread per connection; see the README).")
@_friendly
def serve(model_name, batch_ms, weights, num_classes, classes_file, host, port, max_batch, max_wait_ms, max_queue,
          devices, replicas, cpu_fallback, dtype, workers, size, resize, gpu_decode_min_batch, max_pixels,
          max_body_mb, request_timeout, header_timeout, body_timeout, idle_timeout, max_connections,
          drain_timeout, front) -> None:
    """Serve a model over HTTP with the training eval preprocessing and dynamic batching.

    POST /predict with image bytes -> JSON top-5; GET /healthz (200 once a replica is warm),
    /stats (JSON), /metrics (Prometheus), /trace (Chrome trace). 503 + Retry-After when full,
    504 past the request deadline. SIGTERM or Ctrl-C drains accepted requests and stops.
    """
    import logging

    from fastload.serve.app import ServeOptions, run_server
    from fastload.serve.routes import FrontOptions

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    classes = tuple(c for c in classes_file.read_text().split("\n") if c) if classes_file else None
    limits = FrontOptions(server=front, max_body_bytes=int(max_body_mb * (1 << 20)),
                          header_timeout_s=header_timeout, body_timeout_s=body_timeout, idle_timeout_s=idle_timeout,
                          request_timeout_s=request_timeout, max_connections=max_connections)
    opts = ServeOptions(model=model_name, batch_ms=batch_ms, weights=weights, num_classes=num_classes,
                        classes=classes, host=host, port=port, max_batch=max_batch, max_wait_ms=max_wait_ms,
                        max_queue=max_queue, devices=tuple(d.strip() for d in devices.split(",") if d.strip()),
                        replicas=replicas, cpu_fallback=cpu_fallback, dtype=dtype, workers=workers, size=size,
                        resize=resize, gpu_decode_min_batch=gpu_decode_min_batch, max_pixels=max_pixels,
                        drain_timeout_s=drain_timeout, front=limits)
    run_server(opts, say=lambda msg: click.echo(msg))


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--steps", type=click.IntRange(min=1), default=200, show_default=True,
              help="Measured steps after warm-up; then the command is ended.")
@click.option("--seconds", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="Measured seconds after warm-up; then the command is ended (whichever of --steps and --seconds "
                   "comes first).")
@click.option("--until-end", is_flag=True, help="Measure until the command ends (no --steps or --seconds limit).")
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True, help="Steps not measured.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Output folder [default: runs/profile-<timestamp>].")
@click.option("--headspace", is_flag=True,
              help="Rerun with the training loader replaying its first batches from memory: the perfect-loader bound.")
@click.option("--verify-fix", is_flag=True,
              help="Rerun with the top change fastload can apply from outside (worker count, pin_memory) and print "
                   "predicted vs measured.")
@click.option("--kineto-steps", type=click.IntRange(min=0), default=20, show_default=True,
              help="On CUDA, steps traced with torch.profiler for the GPU timeline (0: off).")
@click.option("--tensorboard", type=click.Path(path_type=Path), default=None,
              help="Also write per-step scalars to this TensorBoard log dir (needs tensorboard).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
@_friendly
def profile(steps, seconds, until_end, warmup, out, headspace, verify_fix, kineto_steps, tensorboard,
            command) -> None:
    """Run COMMAND unchanged and say where its training step waits: `fastload profile -- python train.py`.

    COMMAND is `python script.py ...`, `python -m pkg.train ...` or `torchrun ... script.py ...`.
    A step is one next() on the training loader (the DataLoader that yields most batches).
    Writes profile.json, profile.png, trace.json (and kineto-rank<R>.json on CUDA) to --out.
    Exits with the command's own exit status when it failed.

    `fastload profile compare A/profile.json B/profile.json` prints two profiles side by side.
    """
    from fastload.errors import ProfileError
    from fastload.measure._profile_compare import is_compare_call, read_profile
    from fastload.measure.profile import ProfileOptions, format_summary, run_profile

    if is_compare_call(command):
        from fastload.measure._profile_compare import compare_profiles

        click.echo(compare_profiles(read_profile(Path(command[1])), read_profile(Path(command[2])),
                                    names=(command[1], command[2])))
        return
    opts = ProfileOptions(out=out, steps=None if until_end else steps, seconds=None if until_end else seconds,
                          warmup=warmup, headspace=headspace, verify_fix=verify_fix, kineto_steps=kineto_steps,
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


@main.group()
def recipe() -> None:
    """Run a recipe (recipes/*.toml): every loader stage on the same data, measured."""


@recipe.command("run")
@click.argument("recipe_file", metavar="RECIPE", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Output folder [default: runs/<recipe name>].")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Override run.steps.")
@click.option("--warmup", type=click.IntRange(min=0), default=None, help="Override run.warmup.")
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help="Override run.batch_size.")
@click.option("--image-size", type=click.IntRange(min=8), default=None, help="Override run.image_size.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None, help="Override run.device.")
@click.option("--model", default=None, help="Override run.model ('simulated' or a torchvision model name).")
@click.option("--step-ms", type=click.FloatRange(min=0), default=None, help="Override run.step_ms.")
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
@_friendly
def recipe_run(recipe_file: Path, out: Path | None, steps, warmup, batch_size, image_size, device, model, step_ms,
               folder, store, rounds, cache, read_delay_ms, stages, quiet) -> None:
    """Run every stage of RECIPE in interleaved rounds, print the comparison table, write results to --out.

    Each stage's figure is the median over rounds with a 95% interval. Writes
    results.json (figures, every round, resolved recipe, environment), results.csv,
    comparison.png and traces/<stage>.json (Chrome trace: open in ui.perfetto.dev).
    """
    from fastload.measure.recipe import load_recipe, run_recipe, selected_stages, validate
    from fastload.measure.report import format_table, write_outputs
    from fastload.measure.train import init_distributed
    from fastload.progress import bar as progress_bar

    rec = load_recipe(recipe_file).with_overrides(**{
        "run.steps": steps, "run.warmup": warmup, "run.batch_size": batch_size, "run.image_size": image_size,
        "run.device": device, "run.model": model, "run.step_ms": step_ms, "run.rounds": rounds,
        "dataset.folder": folder, "dataset.store": store, "dataset.cache": cache,
        "dataset.read_delay_ms": read_delay_ms})
    validate(rec)
    rank, world = init_distributed()
    lead = rank == 0
    total = len(selected_stages(rec, stages)) * rec.run.rounds * (rec.run.warmup + rec.run.steps)
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
    out = out or Path("runs") / rec.name
    results, notes = write_outputs(out, rec, outcomes, data)
    click.echo(f"\n{rec.name}: {rec.run.model}"
               + (f" ({rec.run.step_ms:g} ms/batch simulated device step)" if rec.run.model == "simulated" else "")
               + f", batch {rec.run.batch_size}, {rec.run.rounds} x {rec.run.steps} steps after {rec.run.warmup} "
               + f"warm-up, cache {rec.dataset.cache}"
               + (f", {rec.dataset.read_delay_ms:g} ms per file opened" if rec.dataset.read_delay_ms else "")
               + ", "
               + f"device {outcomes[0].result.device if outcomes and outcomes[0].result else rec.run.device}"
               + (f", {world} ranks" if world > 1 else ""))
    click.echo(format_table(results["stages"]))
    click.echo(f"\nverdict: {results['verdict']}")
    for note in notes:
        click.echo(note)
    click.echo(f"results: {out}/results.json, results.csv, comparison.png, traces/")


@recipe.command("compare")
@click.argument("a", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("b", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_friendly
def recipe_compare(a: Path, b: Path) -> None:
    """Print two results.json side by side, stage by stage, with B/A ratios ("~": intervals overlap).

    Two profile.json files (from `fastload profile`) are compared as `fastload profile compare` does.
    """
    from fastload.measure._profile_compare import compare_profiles, read_result_or_profile
    from fastload.measure.report import compare_results

    (kind_a, ra), (kind_b, rb) = read_result_or_profile(a), read_result_or_profile(b)
    if kind_a == kind_b == "profile":
        click.echo(compare_profiles(ra, rb, names=(str(a), str(b))))
        return
    if kind_a != kind_b:
        wrong, kind = (a, kind_a) if kind_a == "profile" else (b, kind_b)
        raise click.ClickException(f"{wrong} is a profile.json (from `fastload profile`), the other a recipe's "
                                   "results.json: they cannot be compared\nHINT: compare two results.json, or "
                                   "two profile.json with `fastload profile compare A/profile.json B/profile.json`")
    click.echo(compare_results(ra, rb))


@bench.command("serve")
@click.option("--model", default="simulated", show_default=True,
              help="'simulated' (a device that sleeps --batch-ms per batch) or a torchvision model (run on --device).")
@click.option("--batch-ms", default="4+0.25*n", show_default=True,
              help="The simulated device's ms per batch of n, 'A+B*n'.")
@click.option("--max-batch", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--loads", default="0.25,0.5,1,1.5", show_default=True,
              help="Offered loads as fractions of the estimated capacity (past 1 is past saturation).")
@click.option("--rates", default=None, help="Offered loads in requests/s instead, comma-separated.")
@click.option("--configs", default=",".join(["before", "after 8ms", "after greedy"]), show_default=True,
              help="Which configurations to run, comma-separated.")
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True,
              help="Interleaved rounds; each point reports the median and the range.")
@click.option("--duration", type=click.FloatRange(min=0.1), default=5.0, show_default=True,
              help="Seconds per point.")
@click.option("--max-requests", type=click.IntRange(min=1), default=5000, show_default=True)
@click.option("--image-size", type=click.IntRange(min=32), default=224, show_default=True)
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="fastload's preprocessing threads [default: the CPUs this process may use].")
@click.option("--device", default="cpu", show_default=True, help="Where the model runs: cpu, cuda, cuda:N, auto.")
@click.option("--fronts", default=None,
              help="Compare HTTP fronts instead of configurations: 'stdlib,asgi' runs each as a fastload serve "
                   "process (its defaults) under the same load; adds server CPU per request and RSS.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="Also write the result here.")
@_friendly
def bench_serve_cmd(model, batch_ms, max_batch, loads, rates, configs, rounds, duration, max_requests, image_size,
                    workers, device, fronts, json_out) -> None:
    """Serving before/after: the seed's (Pillow, one at a time, 50 ms wait) vs fastload's, at several loads.

    Open-loop Poisson load over loopback HTTP; throughput, p50/p99, device busy fraction.
    With --fronts stdlib,asgi: the two HTTP fronts side by side instead.
    """
    from fastload.serve.bench import ServeBenchOptions, bench_serve, format_table, to_json

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
        from fastload.serve.bench_fronts import bench_fronts, check_fronts, format_fronts_table

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


if __name__ == "__main__":  # pragma: no cover
    main()
