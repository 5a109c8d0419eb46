"""``fastload convert | verify | inspect | dataset``: the commands that make, check and describe data.

Must not: import a room at module level (``--help`` stays fast); do the work (each command
builds options, calls one library function, prints).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from fastload.cli._common import Default, friendly, printable
from fastload.image import DEFAULT_SIZE

# the options dataclasses the defaults are read from (imported when a default is needed)
CONVERT = "fastload.pack.convert:ConvertOptions"


@click.command()
@click.argument("src")
@click.argument("dst")
@click.option("--max-side", type=click.IntRange(min=8), default=None,
              help="Downscale images whose LONGER side exceeds N to N (re-encoded as JPEG).")
@click.option("--quality", type=click.IntRange(1, 100), default=None,
              help="JPEG quality for re-encoding [default: 90 with --max-side]. Alone, re-encodes every image.")
@click.option("--encoding", type=click.Choice(["jpeg", "raw", "auto"]), default=Default(CONVERT, "encoding"),
              show_default=True,
              help="jpeg: encoded images (originals where every decoder agrees); raw: RGB pixels, no decode when "
                   "training (10-15x the bytes); auto: raw up to 256x256 pixels (after --max-side), jpeg above.")
@click.option("--lossless", is_flag=True,
              help="Keep non-JPEG sources (PNG, WebP, TIFF, ...) pixel-exact as PNG. By default they are stored as "
                   "JPEG q95 4:4:4, which loads about 4-5x faster (see `fastload bench encode`); the PSNR is reported.")
@click.option("--train-size", type=click.IntRange(min=8), default=DEFAULT_SIZE, show_default=True,
              help="Training crop size the --max-side advice printed after the conversion is for.")
@click.option("--shuffle/--no-shuffle", default=False, help="Write samples in a seeded random order.")
@click.option("--seed", type=int, default=Default(CONVERT, "seed"), show_default=True, help="Seed for --shuffle.")
@click.option("--num-shards", type=click.IntRange(min=1), default=None,
              help="Split the dataset into K shards. With --engine (or a remote SRC/DST): K shards by file count, "
                   "all converted by this command; with --shard-index: this run packs one of them [default: 1].")
@click.option("--shard-index", type=click.IntRange(min=0), default=None,
              help="Which shard this run packs by hand, written to DST/shard-IIIII-of-KKKKK [default: 0].")
@click.option("--engine", type=click.Choice(["local", "ray"]), default=None,
              help="Convert a sharded store (DST/manifest.json + one compacted LMDB file per shard): local = this "
                   "machine's process pool, ray = one Ray task per shard. Implied by s3:// gs:// az:// SRC or DST.")
@click.option("--address", default=None,
              help="--engine ray: the cluster (auto, ray://HOST:PORT) [default: start a local one].")
@click.option("--shared-fs", is_flag=True,
              help="With --address: a local SRC and DST are on a filesystem every node mounts at the same path "
                   "(without it, --address needs s3:// gs:// az:// SRC and DST).")
@click.option("--shard-size", default=None,
              help="Sharded store: target source bytes per shard; MB/GB decimal (64MB = 64,000,000 bytes), MiB/GiB "
                   "binary (64MiB = 67,108,864) [default: 64MiB, unless --num-shards].")
@click.option("--strict", is_flag=True, help="Stop at the first unreadable file instead of skipping it.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Validation processes [default: the CPUs this process may use].")
@click.option("--max-pixels", type=click.IntRange(min=1), default=Default(CONVERT, "max_pixels"), show_default=True,
              help="Refuse larger images as decompression bombs (the default is Pillow's limit).")
@click.option("--chunk-size", type=click.IntRange(min=1), default=Default(CONVERT, "chunk_size"), show_default=True,
              help="Samples per write transaction.")
@click.option("--max-file-bytes", type=click.IntRange(min=1), default=Default(CONVERT, "max_file_bytes"),
              show_default=True, help="Skip files larger than this, unread (the default is 1 GiB).")
@click.option("--follow-symlinks", is_flag=True,
              help="Read symbolic links that point outside SRC (by default they are skipped and reported).")
@click.option("--num-classes", type=click.IntRange(min=1), default=None,
              help="File lists, WebDataset .cls and Parquet with integer labels: the number of classes (labels must "
                   "be 0..N-1; without it, a label far above the count of distinct labels is refused).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@friendly
def convert(src: str, dst: str, max_side, quality, encoding, lossless, train_size, shuffle, seed, num_shards,
            shard_index, engine, address, shared_fs, shard_size, strict, workers, max_pixels, chunk_size,
            max_file_bytes, follow_symlinks, num_classes, quiet) -> None:
    """Pack SRC (an ImageFolder tree, or a CSV/TSV list of path,label) into the LMDB store DST.

    Every file is decoded once; unreadable ones are skipped and listed in DST/report.json.
    Interrupt it at any moment and rerun the same command to resume. When the stored images
    are far larger than --train-size needs, it measures and prints the --max-side that would
    load faster.

    SRC and DST may be s3://BUCKET/PREFIX (also gs://, az://; credentials and endpoint from the
    standard environment variables; any other SCHEME://, or one without a bucket, is refused);
    SRC may also be a folder or prefix of WebDataset .tar shards or of Parquet files (Hugging
    Face layout). With --engine, or such a SRC or DST, DST is a
    sharded store written shard by shard (on Ray with --engine ray) and its manifest.json last.
    """
    from fastload.pack.convert import ConvertOptions
    from fastload.pack.convert import convert as run
    from fastload.store.remote import is_remote

    if lossless and (max_side is not None or quality is not None):
        raise click.BadParameter("cannot be combined with --max-side or --quality, which re-encode as lossy JPEG "
                                 "(for exact downscaled pixels: --max-side N --encoding raw)", param_hint="--lossless")
    is_remote(dst)  # a string that looks like a URL but is not a supported one is refused before anything is written
    if not is_remote(src) and not Path(src).exists():
        raise click.BadParameter(f"{src} does not exist", param_hint="SRC")
    sharded = engine is not None or is_remote(src) or is_remote(dst) or shard_size is not None or _container(src)
    if sharded and shard_index is not None:
        raise click.BadParameter("packs one shard by hand; --engine, --shard-size, remote SRC/DST and tar or "
                                 "Parquet sources convert every shard in one command", param_hint="--shard-index")
    if not sharded and address is not None:
        raise click.BadParameter("needs --engine ray", param_hint="--address")
    if shared_fs and address is None:
        raise click.BadParameter("only means something with --engine ray --address", param_hint="--shared-fs")
    if address is not None and not shared_fs and not (is_remote(src) and is_remote(dst)):
        raise click.BadParameter(
            f"{'SRC' if not is_remote(src) else 'DST'} is a local path, but shard tasks may run on other machines of "
            "the cluster (they cannot read this machine's SRC and would publish into their own DST). Use s3:// "
            "(gs://, az://) SRC and DST, or --shared-fs if both are on a filesystem every node mounts at the same path",
            param_hint="--address")
    if sharded:
        _convert_sharded(src, dst, engine or "local", address, shared_fs, num_shards, shard_size,
                         dict(max_side=max_side, quality=quality, encoding=encoding, lossless=lossless,
                              shuffle=shuffle, seed=seed, strict=strict, workers=workers, chunk_size=chunk_size,
                              max_pixels=max_pixels, max_file_bytes=max_file_bytes,
                              follow_symlinks=follow_symlinks, num_classes=num_classes, progress=not quiet))
        return
    src, dst = Path(src), Path(dst)
    num_shards = num_shards or 1
    shard_index = shard_index or 0
    if shard_index >= num_shards:
        raise click.BadParameter(f"must be < --num-shards ({num_shards})", param_hint="--shard-index")
    opts = ConvertOptions(max_side=max_side, quality=quality, encoding=encoding, lossless=lossless,
                          shuffle=shuffle, seed=seed,
                          num_shards=num_shards, shard_index=shard_index, strict=strict, workers=workers,
                          chunk_size=chunk_size, max_pixels=max_pixels,
                          max_file_bytes=max_file_bytes, follow_symlinks=follow_symlinks,
                          num_classes=num_classes, progress=not quiet)
    report = run(src, dst, opts)
    _print_report(report, report.dst / "report.json")
    if max_side is None and report.stored and not report.already_complete and num_shards == 1:
        advice = _advice(report.dst, train_size)
        if isinstance(advice, str) or advice.speedup is not None:  # measured only for images far larger
            click.echo(advice if isinstance(advice, str) else advice.message(str(src)))


def _print_report(report, full_list_at) -> None:
    """A conversion's warnings, summary, first 20 skipped files and re-encode reasons (local or sharded)."""
    for w in report.warnings:
        click.echo(f"warning: {printable(w)}", err=True)
    click.echo(report.summary_line())
    for s in report.skipped[:20]:
        click.echo(f"  skipped {printable(s['relpath'])}: {printable(s['reason'])}")
    if len(report.skipped) > 20:
        click.echo(f"  ... and {len(report.skipped) - 20} more, see {full_list_at}")
    _print_reasons(report.canonicalised, report.reencoded_reasons, report.lossy, indent="  ")


def _container(src: str) -> bool:
    from fastload.pack.containers import is_container_source

    return is_container_source(src) is not None


def _convert_sharded(src: str, dst: str, engine: str, address, shared_fs: bool, num_shards, shard_size,
                     kw: dict) -> None:
    from fastload.pack.convert import ConvertOptions
    from fastload.pack.engines import EngineOptions, convert_sharded, parse_size

    if kw.pop("strict"):
        raise click.BadParameter("is not available for sharded conversion (shards run independently); bad files "
                                 "are skipped and named in the report", param_hint="--strict")
    if num_shards is not None and shard_size is not None:
        raise click.BadParameter("give --num-shards or --shard-size, not both", param_hint="--shard-size")
    try:
        size = parse_size(shard_size) if shard_size is not None else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--shard-size") from None
    eng = EngineOptions(engine=engine, address=address, shared_fs=shared_fs, num_shards=num_shards,
                        **({"shard_bytes": size} if size is not None else {}))
    report = convert_sharded(src, dst, ConvertOptions(**kw), eng)
    _print_report(report, f"{dst}/manifest.json (counts.skipped)")


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
        # a sharded store of an older fastload has no median of all its writes (and older manifests no key)
        median = lossy.get("psnr_median")
        if isinstance(median, list):
            median = "/".join(f"{m:.1f}" for m in median if m is not None) or None
        elif median is not None:
            median = f"{median:.1f}"
        least = lossy.get("psnr_min")
        click.echo(f"{indent}lossy writes {lossy['count']}: PSNR "
                   + ", ".join(x for x in (f"min {least:.1f} dB" if least is not None else "",
                                           f"median {median} dB" if median is not None else "") if x)
                   + " (against the pixels encoded)")


@click.command()
@click.argument("store")
@click.option("--no-decode", is_flag=True, help="Check checksums only; do not decode.")
@click.option("--decoders", default="fastload", show_default=True,
              help="Comma-separated decoders to check every record with: fastload (the loaders' fast path), "
                   "pil, torchvision, simplejpeg, dali; or 'all'.")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Reader processes.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@friendly
def verify(store: Path, no_decode: bool, decoders: str, workers, as_json: bool, quiet: bool) -> None:
    """Re-read every record of STORE: metadata and record checksums, and a decode with each decoder
    (crash-isolated), compared with Pillow's pixels; exit 1 on any problem.

    A folder of shards with a manifest.json (convert --num-shards) is first checked against it: each
    shard file's size and sha256, and samples.json.gz, as in a bucket.

    STORE may be s3://... (gs://, az://): every shard object is checked against the manifest
    (exists, size, sha256), and each missing or corrupted one is named; then each shard's own class
    names, labels and paths against the manifest's class names and samples.json.gz."""
    from fastload.store.check import DECODERS, report_json, verify_remote_shards, verify_store
    from fastload.store.remote import is_remote

    if is_remote(store):
        checked, problems = verify_remote_shards(store, progress=not quiet and not as_json)
        if as_json:
            click.echo(json.dumps({"store": store, "shards": checked, "ok": not problems,
                                   "problems": [{"object": u, "problem": w} for u, w in problems]}, indent=1))
        else:
            for u, w in problems:
                click.echo(f"{u}: {w}")
            state = "OK" if not problems else f"{len(problems)} problems"
            click.echo(f"{store}: {checked} shard objects checked against the manifest (size, sha256), {state}")
        if problems:
            sys.exit(1)
        return
    store = Path(store)

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
        for f, why in report.shards:
            click.echo(f"{printable(f)}: {why}")
        for i, rel, why in report.failures:
            click.echo(f"sample {i} ({printable(rel)}): {why}")
        state = "OK" if report.ok else f"{len(report.failures) + len(report.shards)} problems"
        per = ", ".join(f"{d} {len(ix)} bad" for d, ix in report.by_decoder().items() if ix)
        checked = "checksums" + (f", decoders {', '.join(report.decoders)}" if report.decoders else "")
        if report.shards:
            checked += f"; shard files that differ from the manifest: {len(report.shards)}"
        click.echo(f"{store}: {report.count} samples checked, {state} ({checked}" + (f"; {per})" if per else ")"))
    if not report.ok:
        sys.exit(1)


@click.command()
@click.argument("store")
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON.")
@click.option("--train-size", type=click.IntRange(min=8), default=DEFAULT_SIZE, show_default=True,
              help="Training crop size for the --max-side advice.")
@click.option("--advise/--no-advise", default=True, show_default=True,
              help="Sample the store and, when its images are far larger than --train-size needs, measure and "
                   "print the --max-side that would load faster (a few seconds on big images).")
@friendly
def inspect(store: Path, as_json: bool, train_size: int, advise: bool) -> None:
    """Show what STORE holds: count, classes, bytes, encodings, options, completeness, size advice.

    STORE may be s3://... (gs://, az://): its shards are read through the node shard cache
    ($FASTLOAD_CACHE/shards, else ~/.cache/fastload/shards), downloaded if not there; no size advice for a URL."""
    from fastload.store.check import inspect_store
    from fastload.store.remote import is_remote

    remote = is_remote(store)
    if not remote:
        store = Path(store)
    info = inspect_store(store)
    advice = None
    if info["complete"] and not remote:
        info.update(_disk_size(store))
    if advise and info["complete"] and info["count"] and not remote:
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
    if info.get("disk_bytes"):
        click.echo(f"  on disk   {info['disk_bytes'] / 1e6:.1f} MB in {info['disk_files']} LMDB file"
                   + ("s" if info["disk_files"] > 1 else "") + " (the records above, plus LMDB's pages and free space)"
                   + ("" if not info.get("min_cache_limit") else
                      f"; in object storage, read by shards: cache_limit at least {info['min_cache_limit'] / 1e6:.1f} "
                      f"MB per rank on a node for the default window (its {info['min_cache_shards']} largest shards: "
                      f"the window, the next one prefetched, one more; more with many workers: docs/streaming.md), "
                      f"{info['disk_bytes'] / 1e6:.1f} MB to keep the whole store"))
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


def _disk_size(store: Path) -> dict:
    """The store's LMDB files on disk (a record count understates them: LMDB's pages, free space) and, for a
    sharded store, the smallest ``cache_limit`` that holds what one rank reads by shards with the default window
    (``2 * window + 1`` shards, the largest: the window being read, the next one prefetched, one more)."""
    from fastload.load.shards import DEFAULT_WINDOW

    shards = sorted(store.glob("shard-*/data.mdb"))
    files = shards or [p for p in (store / "data.mdb",) if p.is_file()]
    sizes = sorted((p.stat().st_size for p in files), reverse=True)
    out = {"disk_bytes": sum(sizes), "disk_files": len(sizes)}
    if shards:  # a sharded store, a single shard included
        need = sizes[:2 * DEFAULT_WINDOW + 1]
        out.update(min_cache_limit=sum(need), min_cache_shards=len(need))
    return out


@click.command("dataset")
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
@friendly
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
