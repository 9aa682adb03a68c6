"""What this machine is, and the machine description that test lists select by.

`detect()` looks at the hardware (GPU kind and count through torch, FlashInfer);
`machine_from_options()` turns the shared flags (`--stage --gpu --gpu-count --backend`,
used by both the pytest plugin and `kvharness list`) into a `Machine`, filling what a
flag leaves open from detection.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import platform
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, cast, get_args

Stage = Literal["pre_merge", "post_merge"]
Backend = Literal["torch", "flashinfer"]
STAGES: tuple[Stage, ...] = get_args(Stage)
BACKENDS: tuple[Backend, ...] = get_args(Backend)

# A machine without CUDA is gpu "cpu" with gpu count 0 (the l0_cpu context selects it).
CPU_GPU_NAME = "cpu"


@dataclass(frozen=True)
class Hardware:
    """What `detect()` found: GPU name ("cpu" without CUDA), count, CUDA, FlashInfer."""

    gpu: str
    gpu_count: int
    cuda: bool
    flashinfer: bool
    cpu_arch: str

    @property
    def backends(self) -> tuple[Backend, ...]:
        """Attention backends that can run here: torch always, flashinfer with CUDA."""
        return ("torch", "flashinfer") if self.flashinfer else ("torch",)


@dataclass(frozen=True)
class Machine:
    """A machine description as the lists see it: what conditions are matched against.

    `backends` is the set of backends this run may use: a block with `backend: X`
    applies when X is among them (all usable ones by default, one with `--backend`).
    """

    stage: Stage
    gpu: str
    gpu_count: int
    backends: tuple[Backend, ...]
    cuda: bool
    cpu_arch: str

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"stage {self.stage!r} is not one of {', '.join(STAGES)}")
        if not self.gpu.strip():
            raise ValueError("gpu name is empty; a machine without a GPU is gpu 'cpu'")
        if self.gpu_count < 0:
            raise ValueError(f"gpu count {self.gpu_count} is negative")
        unknown = [b for b in self.backends if b not in BACKENDS]
        if unknown or not self.backends:
            raise ValueError(f"backends {self.backends!r}: expected some of {', '.join(BACKENDS)}")

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (tuples become lists)."""
        data = asdict(self)
        data["backends"] = list(self.backends)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Machine:
        """Inverse of `as_dict`; raises ValueError (via __post_init__) on bad values."""
        return cls(
            stage=cast(Stage, data["stage"]),
            gpu=str(data["gpu"]),
            gpu_count=int(data["gpu_count"]),
            backends=tuple(cast(Backend, b) for b in data["backends"]),
            cuda=bool(data["cuda"]),
            cpu_arch=str(data["cpu_arch"]),
        )

    def describe(self) -> str:
        """One line for headers and messages."""
        return (
            f"stage={self.stage} gpu={self.gpu!r} gpu_count={self.gpu_count} "
            f"backends={','.join(self.backends)} cuda={'yes' if self.cuda else 'no'}"
        )


def detect() -> Hardware:
    """Detect this machine. Imports torch (and flashinfer only where CUDA is available).

    Without torch or without CUDA the machine is gpu "cpu" with count 0. FlashInfer counts
    as usable when CUDA is available and `flashinfer` imports.
    """
    cpu_arch = platform.machine() or "unknown"
    if importlib.util.find_spec("torch") is None:
        return Hardware(CPU_GPU_NAME, 0, cuda=False, flashinfer=False, cpu_arch=cpu_arch)
    import torch

    if not torch.cuda.is_available():
        return Hardware(CPU_GPU_NAME, 0, cuda=False, flashinfer=False, cpu_arch=cpu_arch)
    name = str(torch.cuda.get_device_name(0))
    count = int(torch.cuda.device_count())
    return Hardware(name, count, cuda=True, flashinfer=_flashinfer_imports(), cpu_arch=cpu_arch)


def _flashinfer_imports() -> bool:
    if importlib.util.find_spec("flashinfer") is None:
        return False
    try:
        importlib.import_module("flashinfer")
    except ImportError:
        # Installed but unusable (e.g. built for another CUDA): report it as absent.
        return False
    return True


def _gpu_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"gpu count {text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"gpu count {value} is negative")
    return value


def _gpu_name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("gpu name is empty; a machine without a GPU is 'cpu'")
    return text


def add_machine_options(add: Callable[..., Any]) -> None:
    """Declare --stage/--gpu/--gpu-count/--backend through `add` (argparse or pytest)."""
    add("--stage", choices=STAGES, default="pre_merge",
        help="pipeline stage whose blocks apply (default: pre_merge)")
    add("--gpu", type=_gpu_name, default=None, metavar="NAME",
        help="GPU name matched by the lists' gpu wildcards (default: detected; 'cpu' without CUDA)")
    add("--gpu-count", type=_gpu_count, default=None, metavar="N",
        help="GPU count matched by system_gpu_count ranges (default: detected)")
    add("--backend", choices=BACKENDS, default=None,
        help="restrict to one attention backend (default: every backend usable here)")


def machine_from_options(
    stage: str, gpu: str | None, gpu_count: int | None, backend: str | None, hardware: Hardware
) -> Machine:
    """The machine description from flag values; what a flag leaves None comes from `hardware`.

    Raises ValueError for a stage or backend outside the closed sets.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    return Machine(
        stage=cast(Stage, stage),
        gpu=hardware.gpu if gpu is None else gpu,
        gpu_count=hardware.gpu_count if gpu_count is None else gpu_count,
        backends=hardware.backends if backend is None else (backend,),
        cuda=hardware.cuda,
        cpu_arch=hardware.cpu_arch,
    )
