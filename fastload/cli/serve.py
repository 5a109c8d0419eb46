"""``fastload serve``: a model over HTTP with the training eval preprocessing and dynamic batching.

Every default is read from ``ServeOptions`` and ``FrontOptions`` (written once, there).

Must not: import a room at module level (``--help`` stays fast); do the work.
"""

from __future__ import annotations

from pathlib import Path

import click
from click.core import ParameterSource

from fastload.cli._common import Default, friendly

# the options dataclasses the defaults are read from (imported when a default is needed)
SERVE = "fastload.serve.app:ServeOptions"
FRONT = "fastload.serve.routes:FrontOptions"


@click.command()
@click.option("--model", "model_name", required=True,
              help="A torchvision.models classification model name, or 'simulated' (with --batch-ms).")
@click.option("--batch-ms", default=None,
              help="For --model simulated: device time per batch of n as 'A+B*n' ms (it sleeps, freeing the CPU).")
@click.option("--weights", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A state_dict file for the model [default: random initialisation; nothing is downloaded].")
@click.option("--num-classes", type=click.IntRange(min=1), default=Default(SERVE, "num_classes"), show_default=True)
@click.option("--classes", "classes_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="A text file with one class name per line, for the JSON answers.")
@click.option("--host", type=str, default=Default(SERVE, "host"), show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=Default(SERVE, "port"), show_default=True)
@click.option("--max-batch", type=click.IntRange(min=1), default=Default(SERVE, "max_batch"), show_default=True)
@click.option("--max-wait-ms", type=click.FloatRange(min=0), default=Default(SERVE, "max_wait_ms"), show_default=True,
              help="How long a partial batch may wait for more requests (0: greedy).")
@click.option("--max-queue", type=click.IntRange(min=1), default=Default(SERVE, "max_queue"), show_default=True,
              help="Requests waiting per replica before new ones get 503 + Retry-After.")
@click.option("--devices", type=str, default=Default(SERVE, "devices", ",".join), show_default=True,
              help="Comma-separated devices, one replica each: auto, cpu, cuda, cuda:0,cuda:1.")
@click.option("--device", type=str, default=None,
              help="One device (auto, cpu, cuda, cuda:1): the single-device spelling of --devices.")
@click.option("--replicas", type=click.IntRange(min=1), default=Default(SERVE, "replicas"), show_default=True,
              help="Replicas on the CPU (with --devices cpu).")
@click.option("--cpu-fallback/--no-cpu-fallback", default=Default(SERVE, "cpu_fallback"), show_default=True,
              help="Beside CUDA replicas, keep a CPU replica that retries a failed device's requests.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default=Default(SERVE, "dtype"),
              show_default=True)
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Preprocessing threads in all [default: the CPUs this process may use].")
@click.option("--size", type=click.IntRange(min=8), default=Default(SERVE, "size"),
              show_default=True, help="Eval crop size.")
@click.option("--resize", type=click.IntRange(min=8), default=Default(SERVE, "resize"), show_default=True,
              help="Shorter side before the crop.")
@click.option("--gpu-decode-min-batch", type=click.IntRange(min=1), default=None,
              help="On CUDA, decode batches of at least N JPEGs on the GPU (nvJPEG).")
@click.option("--max-pixels", type=click.IntRange(min=1), default=Default(SERVE, "max_pixels"), show_default=True,
              help="Refuse images declaring more pixels (checked from the header, before decoding).")
@click.option("--max-body-mb", type=click.FloatRange(min=0.001),
              default=Default(FRONT, "max_body_bytes", lambda b: b / (1 << 20)),
              show_default=True,
              help="Bodies over this get 413, answered before the body is read.")
@click.option("--request-timeout", type=click.FloatRange(min=0.001), default=Default(FRONT, "request_timeout_s"),
              show_default=True,
              help="Seconds before a request gets 504 and leaves the queue.")
@click.option("--header-timeout", type=click.FloatRange(min=0.001), default=Default(FRONT, "header_timeout_s"),
              show_default=True,
              help="Seconds for a request line and headers to arrive, in total (on asgi: added to uvicorn's "
                   "protocol, needs httptools).")
@click.option("--body-timeout", type=click.FloatRange(min=0.001), default=Default(FRONT, "body_timeout_s"),
              show_default=True,
              help="Seconds for a body to arrive.")
@click.option("--idle-timeout", type=click.FloatRange(min=0.001), default=Default(FRONT, "idle_timeout_s"),
              show_default=True,
              help="Seconds an idle keep-alive connection stays open.")
@click.option("--max-connections", type=click.IntRange(min=1), default=Default(FRONT, "max_connections"),
              show_default=True,
              help="Open connections (stdlib: one thread each). At the cap the oldest idle keep-alive connection "
                   "closes to make room; when none is idle, more get 503 + Retry-After (asgi: a request arriving "
                   "over the cap).")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=Default(SERVE, "drain_timeout_s"),
              show_default=True,
              help="On SIGTERM, seconds to finish accepted requests.")
@click.option("--front", type=click.Choice(["stdlib", "asgi"]), default=Default(FRONT, "server"), show_default=True,
              help="HTTP front: the standard library's (a thread per connection, every timeout above) or uvicorn + "
                   "starlette ('fastload[serve]' extra: an event loop, no thread per connection; see docs/serving.md).")
@friendly
def serve(model_name, batch_ms, weights, num_classes, classes_file, host, port, max_batch, max_wait_ms, max_queue,
          devices, device, replicas, cpu_fallback, dtype, workers, size, resize, gpu_decode_min_batch, max_pixels,
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

    if device is not None:
        explicit = click.get_current_context().get_parameter_source("devices") is not ParameterSource.DEFAULT
        if explicit:
            raise click.UsageError("give --device (one device) or --devices (several), not both")
        if "," in device:
            raise click.UsageError(f"--device takes one device, got {device!r}; for several use --devices {device}")
        devices = device
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
