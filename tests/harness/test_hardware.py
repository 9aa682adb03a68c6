"""Hardware detection on this machine and the machine description built from flags."""

from __future__ import annotations

import argparse

import pytest
import torch

from harness.hardware import Hardware, Machine, add_machine_options, detect, machine_from_options

CPU = Hardware("cpu", 0, cuda=False, flashinfer=False, cpu_arch="x86_64")
GPU = Hardware("NVIDIA H100 80GB HBM3", 8, cuda=True, flashinfer=True, cpu_arch="x86_64")


def test_detect_matches_torch() -> None:
    found = detect()
    assert found.cuda is torch.cuda.is_available()
    if not found.cuda:
        assert (found.gpu, found.gpu_count, found.flashinfer, found.backends) == (
            "cpu", 0, False, ("torch",))
    else:
        assert found.gpu == torch.cuda.get_device_name(0)
        assert found.gpu_count == torch.cuda.device_count() > 0


@pytest.mark.parametrize(
    ("flags", "hardware", "expected"),
    [
        pytest.param((None, None, None), CPU, ("cpu", 0, ("torch",)), id="cpu-detected"),
        pytest.param((None, None, None), GPU, ("NVIDIA H100 80GB HBM3", 8, ("torch", "flashinfer")),
                     id="gpu-detected"),
        pytest.param(("NVIDIA B200", 1, None), CPU, ("NVIDIA B200", 1, ("torch",)), id="flags-win"),
        pytest.param((None, None, "torch"), GPU, ("NVIDIA H100 80GB HBM3", 8, ("torch",)),
                     id="one-backend"),
    ],
)
def test_flags_override_detection(
    flags: tuple[str | None, int | None, str | None], hardware: Hardware,
    expected: tuple[str, int, tuple[str, ...]],
) -> None:
    gpu, count, backend = flags
    machine = machine_from_options("post_merge", gpu, count, backend, hardware)
    assert (machine.gpu, machine.gpu_count, machine.backends) == expected
    assert machine.stage == "post_merge" and machine.cuda is hardware.cuda
    assert Machine.from_dict(machine.as_dict()) == machine


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param({"stage": "nightly"}, "stage 'nightly' is not one of pre_merge, post_merge",
                     id="stage"),
        pytest.param({"gpu": " "}, "gpu name is empty", id="gpu"),
        pytest.param({"gpu_count": -2}, "gpu count -2 is negative", id="count"),
        pytest.param({"backends": ("cuda",)}, "backends ('cuda',): expected some of", id="backend"),
    ],
)
def test_bad_machine_is_a_value_error(fields: dict[str, object], message: str) -> None:
    base = {"stage": "pre_merge", "gpu": "cpu", "gpu_count": 0, "backends": ("torch",),
            "cuda": False, "cpu_arch": "x86_64"}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Machine(**{**base, **fields})  # type: ignore[arg-type]


def test_machine_options_parse_and_reject() -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_machine_options(parser.add_argument)
    args = parser.parse_args(["--gpu", "h100", "--gpu-count", "2", "--stage", "post_merge"])
    assert (args.gpu, args.gpu_count, args.stage, args.backend) == ("h100", 2, "post_merge", None)
    with pytest.raises(argparse.ArgumentError, match="gpu count 'two' is not an integer"):
        parser.parse_args(["--gpu-count", "two"])
