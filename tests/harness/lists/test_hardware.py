"""Hardware detection on this machine and the machine description built from flags."""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import pytest
import torch

from harness.lists.gpus import FEATURES, capability_of, features_of
from harness.lists.hardware import (
    Hardware,
    Machine,
    MachineFlags,
    add_machine_options,
    detect,
    machine_from_options,
)
from harness.lists.schema import KNOWN_TERMS
from tests.hang_guard import run_child

ROOT = Path(__file__).resolve().parents[3]

CPU = Hardware("cpu", 0, cuda=False, flashinfer=False, cpu_arch="x86_64")
GPU = Hardware("NVIDIA H100 80GB HBM3", 8, cuda=True, flashinfer=True, cpu_arch="x86_64",
               compute_capability="9.0")


@pytest.mark.parametrize("driver", ["here", "asked"], ids=["drivers-here", "a-driver-path"])
def test_detect_matches_torch(driver: str, tmp_path: Path) -> None:
    # As this machine's driver paths say, and with a driver path that exists (torch asked
    # whatever they say).
    found = detect() if driver == "here" else detect((str(tmp_path),))
    assert found.cuda is torch.cuda.is_available()
    if not found.cuda:
        assert (found.gpu, found.gpu_count, found.flashinfer, found.backends) == (
            "cpu", 0, False, ("torch",))
    else:
        assert found.gpu == torch.cuda.get_device_name(0)
        assert found.gpu_count == torch.cuda.device_count() > 0


@pytest.mark.skipif(platform.system() != "Linux", reason="driver paths are Linux's")
def test_without_a_gpu_driver_detection_imports_no_torch(tmp_path: Path) -> None:
    """A machine without a GPU driver is a CPU machine, known without torch's import (each
    process that selects by the lists paid it, an xdist controller that runs no test too)."""
    probe = ("import sys; from harness.lists.hardware import detect; "
             f"found = detect(({str(tmp_path / 'no-driver')!r},)); "
             "print(found.gpu, found.gpu_count, found.cuda, 'torch' in sys.modules)")
    done = run_child([sys.executable, "-c", probe], cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["cpu", "0", "False", "False"]


@pytest.mark.parametrize(
    ("flags", "hardware", "expected"),
    [
        pytest.param((None, None, None), CPU, ("cpu", 0, ("torch",), None, False),
                     id="cpu-detected"),
        pytest.param((None, None, None), GPU,
                     ("NVIDIA H100 80GB HBM3", 8, ("torch", "flashinfer"), "9.0", False),
                     id="gpu-detected"),
        # A GPU this machine lacks is pretended: it brings what such a machine has.
        pytest.param(("NVIDIA B200", 2, None), CPU,
                     ("NVIDIA B200", 2, ("torch", "flashinfer"), "10.0", True), id="pretend-b200"),
        pytest.param(("NVIDIA H100", None, None), CPU,
                     ("NVIDIA H100", 1, ("torch", "flashinfer"), "9.0", True),
                     id="pretend-counts-one"),
        pytest.param(("NVIDIA H100", 1, "torch"), CPU,
                     ("NVIDIA H100", 1, ("torch",), "9.0", True), id="pretend-one-backend"),
        pytest.param(("Mystery GPU", 1, None), CPU,
                     ("Mystery GPU", 1, ("torch", "flashinfer"), None, True),
                     id="pretend-unknown-kind"),
        pytest.param(("cpu", None, None), GPU, ("cpu", 0, ("torch",), None, True),
                     id="pretend-cpu"),
        pytest.param((None, None, "torch"), GPU,
                     ("NVIDIA H100 80GB HBM3", 8, ("torch",), "9.0", False), id="one-backend"),
    ],
)
def test_flags_override_detection(
    flags: tuple[str | None, int | None, str | None], hardware: Hardware,
    expected: tuple[str, int, tuple[str, ...], str | None, bool],
) -> None:
    gpu, count, backend = flags
    machine = machine_from_options(MachineFlags("post_merge", gpu, count, backend), hardware)
    assert (machine.gpu, machine.gpu_count, machine.backends, machine.compute_capability,
            machine.pretended) == expected
    assert machine.stage == "post_merge" and machine.cuda is hardware.cuda
    assert Machine.from_dict(machine.as_dict()) == machine


@pytest.mark.parametrize(
    ("name", "capability", "fp8", "fp4"),
    [
        ("NVIDIA H100 80GB HBM3", "9.0", True, False),
        ("NVIDIA H100 PCIe", "9.0", True, False),
        ("NVIDIA GH200 480GB", "9.0", True, False),
        ("NVIDIA B200", "10.0", True, True),
        ("NVIDIA GB200", "10.0", True, True),
        ("NVIDIA A100-SXM4-80GB", "8.0", False, False),
        ("NVIDIA A10G", "8.6", False, False),
        ("NVIDIA L40S", "8.9", True, False),
        ("cpu", None, False, False),
    ],
)
def test_gpu_kinds_imply_capability_and_features(name: str, capability: str | None,
                                                 fp8: bool, fp4: bool) -> None:
    assert capability_of(name) == capability
    features = features_of(capability)
    assert (features["supports_fp8"], features["supports_fp4"]) == (fp8, fp4)
    assert set(features) == set(FEATURES)


def test_known_terms_hold_every_feature() -> None:
    assert {k for k in KNOWN_TERMS if k.startswith("supports_")} == set(FEATURES)


def test_machine_flags_repeat_what_was_given() -> None:
    flags = MachineFlags("pre_merge", "NVIDIA H100", 1, None, "mpi")
    assert flags.argv() == ["--stage", "pre_merge", "--gpu", "NVIDIA H100", "--gpu-count", "1"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param({"stage": "nightly"}, "stage 'nightly' is not one of pre_merge, post_merge",
                     id="stage"),
        pytest.param({"gpu": " "}, "gpu name is empty", id="gpu"),
        pytest.param({"gpu_count": -2}, "gpu count -2 is negative", id="count"),
        pytest.param({"backends": ("cuda",)}, "backends ('cuda',): expected some of", id="backend"),
        # Arabic-Indic digits: `\d` would have read SM 90 and every feature.
        pytest.param({"compute_capability": "\u0669.\u0660"},
                     "compute capability '\u0669.\u0660' is not <major>.<minor>", id="capability-digits"),
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
