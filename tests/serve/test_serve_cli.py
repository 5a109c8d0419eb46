"""fastload serve's command line: its options reach ServeOptions, bad configurations fail clearly."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from fastload.cli import main
from fastload.errors import ServeError
from fastload.serve import ServeOptions
from fastload.serve.models import SimulatedDevice, build_model, parse_batch_ms


def test_help_lists_the_production_options():
    r = CliRunner().invoke(main, ["serve", "--help"])
    assert r.exit_code == 0
    for option in ("--devices", "--replicas", "--dtype", "--max-pixels", "--request-timeout", "--header-timeout",
                   "--body-timeout", "--idle-timeout", "--max-connections", "--max-body-mb", "--drain-timeout",
                   "--batch-ms", "--cpu-fallback", "--front"):
        assert option in r.output, option


@pytest.mark.parametrize("args, message", [
    (["--model", "no_such_net"], "Unknown value 'no_such_net' for --model"),
    (["--model", "simulated"], "needs --batch-ms"),
    (["--model", "simulated", "--batch-ms", "fast"], "must look like 'A+B*n'"),
    (["--model", "resnet18", "--batch-ms", "4"], "for --model simulated only"),
    (["--model", "simulated", "--batch-ms", "4", "--devices", "cuda:0", "--replicas", "2"], "--replicas N runs"),
    (["--model", "simulated", "--batch-ms", "4", "--devices", "cpu,cpu"], "names a device twice"),
])
def test_bad_configurations_exit_1_with_a_clear_message(args, message):
    r = CliRunner().invoke(main, ["serve", "--port", "0", *args])
    assert r.exit_code == 1, r.output
    assert message in r.output and "Traceback" not in r.output


def test_batch_ms_forms():
    assert parse_batch_ms("4+0.25*n") == (4.0, 0.25)
    assert parse_batch_ms(" 3 ") == (3.0, 0.0)
    m = build_model("simulated", batch_ms="2+1*n", num_classes=7)
    assert isinstance(m, SimulatedDevice) and m.batch_ms(3) == 5.0 and m.num_classes == 7


def test_serve_options_are_validated():
    with pytest.raises(ServeError, match="--dtype"):
        ServeOptions(model="simulated", dtype="int8")
    with pytest.raises(ServeError, match="--size"):
        ServeOptions(model="simulated", size=300, resize=256)


def test_cuda_asked_for_without_cuda_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = CliRunner().invoke(main, ["serve", "--port", "0", "--model", "simulated", "--batch-ms", "4",
                                  "--devices", "cuda:0"])
    assert r.exit_code == 1 and "no CUDA device is available" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("args, devices", [(["--device", "cpu"], ("cpu",)), (["--devices", "cpu"], ("cpu",)),
                                           (["--devices", "cuda:0,cuda:1"], ("cuda:0", "cuda:1")), ([], ("auto",))])
def test_device_is_the_single_device_spelling_of_devices(monkeypatch, args, devices):
    """Issue #21: `fastload serve --device cpu` failed with "No such option"."""
    seen = []
    monkeypatch.setattr("fastload.serve.app.run_server", lambda opts, say: seen.append(opts))
    r = CliRunner().invoke(main, ["serve", "--port", "0", "--model", "simulated", "--batch-ms", "4", *args])
    assert r.exit_code == 0, r.output
    assert [o.devices for o in seen] == [devices]


@pytest.mark.parametrize("args, message", [(["--device", "cpu", "--devices", "cpu"], "not both"),
                                           (["--device", "cuda:0,cuda:1"], "--devices cuda:0,cuda:1")])
def test_device_takes_one_device_and_not_beside_devices(args, message):
    r = CliRunner().invoke(main, ["serve", "--port", "0", "--model", "simulated", "--batch-ms", "4", *args])
    assert r.exit_code == 2 and message in r.output, r.output
